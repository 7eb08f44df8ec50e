"""One forward for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3).

The forward is a pure function of its inputs: token ids, positions and the attention metadata
are passed in, the KV cache is written through the slot mapping. No per-step globals, so the same
call serves eager prefill, eager decode and a captured CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..kernels import Ops
from ..kernels.rope import rope_cos_sin
from .config import ModelConfig
from .layer_ops import LayerOps
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
        self.layer_ops = LayerOps.build(ops, shard, config.rms_norm_eps)
        self.ops = self.layer_ops.ops
        if shard.sharded:
            whole = weights.lm_head.shape[0] == config.vocab_size  # a self-draft's is split
            if whole and shard.splits_vocab(config.vocab_size):
                # a copy of this rank's rows (tied embeddings keep the whole table for lookup)
                weights = replace(weights, lm_head=shard.part(weights.lm_head, 0))
        self.weights = weights
        device = weights.embed.device
        self.cos, self.sin = rope_cos_sin(max_positions, config.head_dim, config.rope_theta,
                                          config.rope_scaling, device=device)
        self.scale = config.head_dim ** -0.5
        if self.ops.link_weights is not None:
            # the launch order, for op sets that warm L2 with the next projection's weight
            self.ops.link_weights([t for layer in weights.layers
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
        lo, w = self.layer_ops, self.weights
        h, residual = hidden.out, hidden.residual
        for i, layer in enumerate(w.layers[first_layer:], start=first_layer):
            # the norm after this layer, which its last projection may begin
            next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else None
            # Each norm feeds exactly one projection: one op, so a kernel may fuse the two.
            qkv, residual = lo.norm_qkv(h, residual, layer)
            attended = self._attention(qkv, positions, attn, layer, kv.k[i], kv.v[i])
            h, residual = lo.o(attended, residual, layer)
            h, residual = lo.mlp(h, residual, layer, next_norm)
        return FinalHidden(h, residual)

    def compute_logits(self, hidden: FinalHidden) -> torch.Tensor:
        """[T, vocab] in the model's dtype: the final (add +) RMSNorm and the LM head. Every
        consumer (sampling, logprobs, rejection) upcasts as it reads, which is exact; a separate
        fp32 copy cost a full extra pass over the logits each step."""
        w = self.weights
        return self.layer_ops.logits(hidden.out, hidden.residual, w.norm, w.lm_head,
                                     self.config.vocab_size)

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
