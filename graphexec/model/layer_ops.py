"""LayerOps: the projections of a decoder layer as the model's layer loop calls them (norm and
qkv, o, norm and the MLP, and the LM head), over an op set (kernels.Ops) and a Shard.

It keeps out of the layer loop how they compose: an op set may add the residual stream in a
projection's epilogue and begin the next norm there (Ops.out_linear, Ops.mlp; the stream is then
h alone, residual None, or a Prenormed), and on a tensor-parallel rank o and down return partial
sums that an all-reduce completes, which may also do the next residual add and norm (a Normed)
or take words its projection already sent to the peers (a Pushed)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels import Normed, Ops
from .shard import Shard


@dataclass(frozen=True)
class LayerOps:
    ops: Ops
    shard: Shard
    eps: float

    @classmethod
    def build(cls, ops: Ops, shard: Shard, eps: float) -> LayerOps:
        """On a rank, o and down return partial sums. An op set that adds the residual stream
        in their epilogue would add it once per rank, and one that begins the next norm there
        would normalise a partial sum: its rank's variant (partial sums only, no norm begun),
        or else the plain projections; the residual is added once, after the sum, by the
        all-reduce or the next norm (_reduce). A self-draft gets its target's set, a rank's
        already."""
        if shard.sharded and not ops.rank_set:
            ops = (ops.for_rank(shard.rank) if ops.for_rank is not None
                   else replace(ops, out_linear=None, mlp=None))
        return cls(ops, shard, eps)

    @property
    def _takes_normed(self) -> bool:
        """A rank's op set takes a Normed where a norm_linear is due (Ops.for_rank)."""
        return self.shard.sharded and self.ops.rank_set

    def norm_qkv(self, h, residual, layer):
        """(qkv projection of the input norm of h + residual, the stream h + residual)."""
        return self.norm_linear(h, residual, layer.input_norm, layer.qkv, layer.qkv_bias)

    def o(self, attended: torch.Tensor, residual, layer):
        """(h, residual) after the o projection: the stream is h + residual, or h when residual
        is None; o's sums are reduced in slot 0, down's in slot 1, so consecutive reductions
        alternate in every forward (kernels/all_reduce_triton.py)."""
        ops = self.ops
        if ops.out_linear is None:
            h = ops.linear(attended, layer.o)
        else:
            h, residual = ops.out_linear(attended, layer.o, residual, layer.post_norm,
                                         **self._push(0))
        return self._reduce(h, residual, layer.post_norm, 0), residual

    def mlp(self, h, residual, layer, next_norm: torch.Tensor | None):
        """(h, residual) after the post-attention norm and the MLP; next_norm: the next layer's
        input norm (None after the last layer), which the down projection may begin."""
        ops = self.ops
        if ops.mlp is None:
            gate_up, residual = self.norm_linear(h, residual, layer.post_norm, layer.gate_up)
            h = ops.silu_mul_linear(gate_up, layer.down)
        else:
            h, residual = ops.mlp(h, residual, layer.post_norm, self.eps, layer.gate_up,
                                  layer.down, next_norm, **self._push(1))
        return self._reduce(h, residual, next_norm, 1), residual

    def logits(self, h, residual, norm_weight: torch.Tensor, lm_head: torch.Tensor,
               vocab_size: int) -> torch.Tensor:
        """The final (add +) RMSNorm and the LM head, one op so a kernel may fuse the two; on a
        rank whose LM head holds a vocabulary slice, the whole logits gathered."""
        split = lm_head.shape[0] != vocab_size
        gather = self.shard.gather_target() if self._takes_normed and split else None
        logits, _ = self.ops.norm_linear(h, residual, norm_weight, self.eps, lm_head,
                                         **({} if gather is None else {"gather": gather}))
        if logits.shape[-1] != vocab_size:  # this rank's slice of the vocabulary
            logits = self.shard.gather_vocab(logits)
        return logits

    def norm_linear(self, h, residual, norm_weight, weight, bias=None):
        """(projection of norm(h + residual), h + residual): ops.norm_linear, or for a Normed
        h (the all-reduce before did the add and the norm) the projection alone."""
        if isinstance(h, Normed):
            assert h.norm_weight is norm_weight, "a Normed reaches only the norm it applied"
            if not self._takes_normed:
                return self.ops.linear(h.x, weight, bias), h.summed
        return self.ops.norm_linear(h, residual, norm_weight, self.eps, weight, bias)

    def _push(self, slot: int) -> dict:
        """push= for a rank set's out_linear and mlp: where the all-reduce in `slot` may take
        its message from the projection's epilogue (Shard.push_target), or nothing."""
        push = self.shard.push_target(slot) if self._takes_normed else None
        return {} if push is None else {"push": push}

    def _reduce(self, h, residual, norm_weight, slot: int):
        """A sharded model's partial sum h over the ranks: with the residual add and the norm
        by norm_weight (the next one, None after the last layer) folded into the all-reduce
        where the reducer can and the op set allows (a Normed), else the sum alone. h itself
        when not sharded. A Pushed h was sent to the peers by its projection already."""
        if not self.shard.sharded:
            return h
        if norm_weight is not None and self.ops.all_reduce_norm:
            normed = self.shard.all_reduce_norm(h, residual, norm_weight, self.eps, slot)
            if normed is not None:
                return normed
        return self.shard.all_reduce(h, slot)
