"""One forward for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3).

The forward is a pure function of its inputs: token ids, positions and the attention metadata
are passed in, the KV cache is written through the slot mapping. No per-step globals, so the same
call serves eager prefill, eager decode and a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..kernels import Normed, Ops
from ..kernels.rope import rope_cos_sin
from ..kernels.weight_order import link_next_weights
from .config import ModelConfig
from .shard import UNSHARDED, Shard


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q, k, v projections stacked
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the same tensor as embed when embeddings are tied


@dataclass
class AttentionInputs:
    """What attention needs for one forward. Decode: one token per row, cu_seqlens_q is None.
    Prefill: a packed varlen batch described by cu_seqlens_q."""

    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V goes to
    block_tables: torch.Tensor  # [rows, max_blocks]
    seq_lens: torch.Tensor  # [rows] keys each row attends to (new tokens included)
    cu_seqlens_q: torch.Tensor | None = None  # [rows + 1], prefill only
    # Decode only: every row is a different sequence with its own blocks (a row's new token
    # sits at position seq_len - 1, its slot in that row's blocks), so no row attends to
    # another row's new token and rope, the KV write and attention may run as one kernel.
    # False for the speculative verify, whose K + 1 rows per sequence read each other's.
    rows_are_sequences: bool = False
    # A mixed step (capture/mixed.py): its first decode_mask.numel() tokens may be decode rows
    # (decode_mask says which), attended as a decode step attends them (`decode`, their own
    # metadata); every token also goes through the prefill attention above, which gives the
    # decode rows' tokens the scratch slot and no sequence, and whose result they drop.
    decode: "AttentionInputs | None" = None
    decode_mask: torch.Tensor | None = None
    # Decode: size the attention kernel's split count as for a batch of this many rows rather
    # than its own row count (a mixed step's decode part, mostly inert places).
    split_rows: int | None = None


@dataclass
class FinalHidden:
    """What the last layer leaves: its output and the residual stream, not yet summed and
    normed. compute_logits applies the final add + RMSNorm as the LM head's fused prologue, so
    a one-row step saves that launch; select rows (a prefill's last tokens) with rows()."""

    out: torch.Tensor  # [T, hidden]
    residual: torch.Tensor | None  # None for a model without layers: out is the embeddings

    def rows(self, index: torch.Tensor) -> FinalHidden:
        return FinalHidden(self.out[index],
                           None if self.residual is None else self.residual[index])


@dataclass
class KVCache:
    k: list[torch.Tensor] = field(default_factory=list)  # per layer [blocks, block_size, Hk, D]
    v: list[torch.Tensor] = field(default_factory=list)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, ops: Ops,
                 max_positions: int, shard: Shard = UNSHARDED):
        """config: the shape these weights compute (a rank's share: shard.config)."""
        self.config = config
        self.shard = shard
        if shard.sharded:
            # o and down return partial sums here. An op set that adds the residual stream in
            # their epilogue would add it once per rank, and one that begins the next norm there
            # would normalise a partial sum: its rank's variant (partial sums only, no norm
            # begun), or else the plain projections; the residual is added once, after the
            # sum, by the all-reduce or the next norm (_reduce). A self-draft gets its target's
            # set, a rank's already.
            if not ops.rank_set:
                ops = (ops.for_rank(shard.rank) if ops.for_rank is not None
                       else replace(ops, out_linear=None, mlp=None))
            whole = weights.lm_head.shape[0] == config.vocab_size  # a self-draft's is split
            if whole and shard.splits_vocab(config.vocab_size):
                # a copy of this rank's rows (tied embeddings keep the whole table for lookup)
                weights = replace(weights, lm_head=shard.part(weights.lm_head, 0))
        self.weights = weights
        self.ops = ops
        # a rank's op set takes a Normed where a norm_linear is due (Ops.for_rank)
        self._ops_take_normed = shard.sharded and ops.rank_set
        device = weights.embed.device
        self.cos, self.sin = rope_cos_sin(max_positions, config.head_dim, config.rope_theta,
                                          config.rope_scaling, device=device)
        self.scale = config.head_dim ** -0.5
        # the launch order, for op sets that warm L2 with the next projection's weight
        link_next_weights([t for layer in weights.layers
                           for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                          + [weights.lm_head])

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionInputs,
                kv: KVCache) -> FinalHidden:
        """input_ids, positions: [T]. Returns the last layer's output before the final norm,
        which compute_logits applies."""
        w = self.weights
        # A normal launch, never a programmatic dependent (kernels/pdl.py): every kernel after
        # it may read, before its PDL wait, what was written before the forward began (the
        # step's metadata, the KV of earlier positions); the fused attention does.
        h = F.embedding(input_ids, w.embed)
        # the first layer's residual stream starts at the embeddings
        return self.forward_layers(FinalHidden(h, None), positions, attn, kv)

    def forward_layers(self, hidden: FinalHidden, positions: torch.Tensor,
                       attn: AttentionInputs, kv: KVCache, first_layer: int = 0) -> FinalHidden:
        """Layers first_layer.. on the state `hidden` that the layers before it left (the
        embeddings, with residual None, for layer 0). The speculative verify starts after a
        self-draft's layers (capture/spec_iteration.py). As in forward, the kernel before the
        first layer must be a normal launch (there: the copies that stack the draft's states),
        since the fused attention reads ahead of its PDL wait."""
        cfg, ops, w = self.config, self.ops, self.weights
        h, residual = hidden.out, hidden.residual
        for i, layer in enumerate(w.layers[first_layer:], start=first_layer):
            # the norm after this layer, which its last projection may half do (Prenormed)
            next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else None
            # Each norm feeds exactly one projection: one op, so a kernel may fuse the two.
            qkv, residual = self._norm_linear(h, residual, layer.input_norm, layer.qkv,
                                              layer.qkv_bias)
            o = self._attention(qkv, positions, attn, layer, kv.k[i], kv.v[i])
            # (h, residual): the stream is h + residual, or h when residual is None (an op set
            # that adds in the projection's epilogue); a sharded model's h is a partial sum,
            # reduced (and, where it can, normed: a Normed) by _reduce.
            # o's sums are reduced in slot 0, down's in slot 1, so consecutive reductions
            # alternate in every forward (kernels/all_reduce_triton.py)
            if ops.out_linear is None:
                h = ops.linear(o, layer.o)
            else:
                h, residual = ops.out_linear(o, layer.o, residual, layer.post_norm,
                                             **self._push(0))
            h = self._reduce(h, residual, layer.post_norm, 0)
            if ops.mlp is None:
                gate_up, residual = self._norm_linear(h, residual, layer.post_norm,
                                                      layer.gate_up)
                h = ops.silu_mul_linear(gate_up, layer.down)
            else:
                h, residual = ops.mlp(h, residual, layer.post_norm, cfg.rms_norm_eps,
                                      layer.gate_up, layer.down, next_norm, **self._push(1))
            h = self._reduce(h, residual, next_norm, 1)
        return FinalHidden(h, residual)

    def _norm_linear(self, h, residual, norm_weight, weight, bias=None):
        """(projection of norm(h + residual), h + residual): ops.norm_linear, or for a Normed
        h (the all-reduce before did the add and the norm) the projection alone."""
        if isinstance(h, Normed):
            assert h.norm_weight is norm_weight, "a Normed reaches only the norm it applied"
            if not self._ops_take_normed:
                return self.ops.linear(h.x, weight, bias), h.summed
        return self.ops.norm_linear(h, residual, norm_weight, self.config.rms_norm_eps, weight,
                                    bias)

    def _push(self, slot: int) -> dict:
        """push= for a rank set's out_linear and mlp: where the all-reduce in `slot` may take
        its message from the projection's epilogue (Shard.push_target), or nothing."""
        push = self.shard.push_target(slot) if self._ops_take_normed else None
        return {} if push is None else {"push": push}

    def _reduce(self, h, residual, norm_weight, slot: int):
        """A sharded model's partial sum h over the ranks: with the residual add and the norm
        by norm_weight (the next one, None after the last layer) folded into the all-reduce
        where the reducer can and the op set allows (a Normed), else the sum alone. h itself
        when not sharded. A Pushed h was sent to the peers by its projection already."""
        if not self.shard.sharded:
            return h
        if norm_weight is not None and self.ops.all_reduce_norm:
            normed = self.shard.all_reduce_norm(h, residual, norm_weight,
                                                self.config.rms_norm_eps, slot)
            if normed is not None:
                return normed
        return self.shard.all_reduce(h, slot)

    def compute_logits(self, hidden: FinalHidden) -> torch.Tensor:
        """[T, vocab] in the model's dtype: the final (add +) RMSNorm and the LM head, one op
        so a kernel may fuse the two. Every consumer (sampling, logprobs, rejection) upcasts
        as it reads, which is exact; a separate fp32 copy cost a full extra pass over the
        logits each step (24 us at batch 64 on llama-1b)."""
        w = self.weights
        # a rank set may return the whole logits of a split LM head (Shard.gather_target)
        split = w.lm_head.shape[0] != self.config.vocab_size
        gather = self.shard.gather_target() if self._ops_take_normed and split else None
        logits, _ = self.ops.norm_linear(hidden.out, hidden.residual, w.norm,
                                         self.config.rms_norm_eps, w.lm_head,
                                         **({} if gather is None else {"gather": gather}))
        if logits.shape[-1] != self.config.vocab_size:  # this rank's slice of the vocabulary
            logits = self.shard.gather_vocab(logits)
        return logits

    def _attention(self, qkv, positions, attn: AttentionInputs, layer: LayerWeights,
                   k_cache, v_cache) -> torch.Tensor:
        """[T, q_size]: the attention output, before the o projection."""
        cfg, ops = self.config, self.ops
        t = qkv.shape[0]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        if attn.decode is not None:
            r = attn.decode_mask.shape[0]
            # the decode rows first: they read only their own sequences' KV, never the chunks'
            o_dec = self._attend(q[:r], k[:r], v[:r], positions[:r], attn.decode, k_cache,
                                 v_cache)
            o = self._attend(q, k, v, positions, replace(attn, decode=None), k_cache, v_cache)
            o[:r] = torch.where(attn.decode_mask[:, None, None], o_dec, o[:r])
        else:
            o = self._attend(q, k, v, positions, attn, k_cache, v_cache)
        return o.reshape(t, cfg.q_size)

    def _attend(self, q, k, v, positions, attn: AttentionInputs, k_cache,
                v_cache) -> torch.Tensor:
        """[T, Hq, D]: rope, the KV write and attention for one kind of rows."""
        ops = self.ops
        hint = {} if attn.split_rows is None else dict(split_rows=attn.split_rows)
        if (attn.cu_seqlens_q is None and attn.rows_are_sequences
                and ops.rope_decode_attention is not None):
            return ops.rope_decode_attention(q, k, v, positions, self.cos, self.sin, k_cache,
                                             v_cache, attn.slot_mapping, attn.block_tables,
                                             attn.seq_lens, self.scale, **hint)
        q = ops.rope_write_kv(q, k, v, positions, self.cos, self.sin, k_cache, v_cache,
                              attn.slot_mapping)
        if attn.cu_seqlens_q is None:
            return ops.decode_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                        self.scale, **hint)
        return ops.prefill_attention(q, k_cache, v_cache, attn.cu_seqlens_q, attn.seq_lens,
                                     attn.block_tables, self.scale)
