"""Shard: which part of the model one tensor-parallel rank holds, Megatron style.

qkv and gate_up are split by output rows (each rank computes whole heads and a slice of the MLP
width), o and down by input columns, so each of those two returns a partial sum that one
all-reduce completes. KV heads are divided like the query heads: rank r holds query heads
[r * Hq / n, (r + 1) * Hq / n) and the KV heads they read, and only those heads' paged cache.
The LM head is split by vocabulary rows when the size divides the vocabulary (each rank streams
its slice, one all-gather joins the logits, or at 33-64 rows the LM head's epilogue lands them
in the peers' memory: gather_target; at batch 1 the head is a tenth of llama-8b's bytes),
else replicated. Embedding and norms are replicated. Every rank ends with the same whole logits
and samples the same tokens, so the device-resident next inputs never diverge.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels import Normed, Pushed
from ..kernels.quant import QuantizedWeight
from .config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    # The torch.distributed group the partial sums are reduced over (None when size == 1).
    group: object | None = None
    # Small sums go through this instead of the group's NCCL all-reduce when set
    # (parallel/symmetric.py: a one-shot all-reduce over symmetric memory).
    reducer: object | None = None

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def check(self, mc: ModelConfig, model: str) -> None:
        """A model whose heads or MLP width do not split evenly cannot be served at this size."""
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            v = getattr(mc, name)
            if v % self.size:
                raise ValueError(f"tensor_parallel_size={self.size} does not divide "
                                 f"{name}={v} of model={model!r}")

    def config(self, mc: ModelConfig) -> ModelConfig:
        """The shape this rank computes: its heads, KV heads and MLP width; hidden size and
        vocabulary whole."""
        if not self.sharded:
            return mc
        return replace(mc, num_heads=mc.num_heads // self.size,
                       num_kv_heads=mc.num_kv_heads // self.size,
                       intermediate_size=mc.intermediate_size // self.size)

    def bounds(self, full: int) -> tuple[int, int]:
        n = full // self.size
        return self.rank * n, (self.rank + 1) * n

    def splits_vocab(self, vocab_size: int) -> bool:
        return self.sharded and vocab_size % self.size == 0

    def gather_vocab(self, t: torch.Tensor) -> torch.Tensor:
        """[T, V / size] logits of this rank's vocabulary slice -> [T, V], the same on every
        rank."""
        if not self.sharded:
            return t
        import torch.distributed as dist

        rows, cols = t.shape
        parts = torch.empty((self.size * rows, cols), dtype=t.dtype, device=t.device)
        # all_gather_single is the newer name of the same collective
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(parts, t.contiguous(), group=self.group)
        return parts.view(self.size, rows, cols).transpose(0, 1).reshape(rows, self.size * cols)

    def part(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's slice of a whole tensor along dim (None: replicated). A copy, so the
        whole tensor can be freed."""
        if dim is None or not self.sharded:
            return t
        start, stop = self.bounds(t.shape[dim])
        if isinstance(t, QuantizedWeight):  # a quantized LM head: its scales go with its rows
            return t.rows(start, stop) if dim == 0 else t.cols(start, stop)
        return t.narrow(dim, start, stop - start).clone()

    def push_target(self, slot: int):
        """Where the projection before the all-reduce in `slot` may send its partial sum from
        its epilogue (kernels/all_reduce_triton.Push), or None: the reducer sends it."""
        push = getattr(self.reducer, "push", None)
        return push(slot) if self.sharded and push is not None else None

    def gather_target(self):
        """Where a rank's LM head may land its logits in the peers' memory from its epilogue
        (kernels/gather_triton.Landing), or None: gather_vocab after it."""
        gather = getattr(self.reducer, "gather", None)
        return gather() if self.sharded and gather is not None else None

    def all_reduce(self, t: torch.Tensor | Pushed, slot: int) -> torch.Tensor:
        """Sums a row-parallel projection's partial outputs over the ranks: in place through
        NCCL or gloo, into a new tensor through the reducer. slot: 0 for o, 1 for down, so
        consecutive all-reduces alternate (kernels/all_reduce_triton.py). A Pushed t is in
        the peers' boxes already (push_target)."""
        if isinstance(t, Pushed):
            return self.reducer(t.x, slot, pushed=True)
        if not self.sharded:
            return t
        if self.reducer is not None and self.reducer.fits(t):
            return self.reducer(t, slot)
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_norm(self, t: torch.Tensor | Pushed, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, slot: int) -> Normed | None:
        """all_reduce(t, slot), then the residual add and RMSNorm that follow it in the model,
        in one kernel where the reducer has one and takes these operands (a one-row step saves
        the norm prologue each program of the next projection would repeat; a 64-row step the
        norm's launch); None where it does not: the caller then all-reduces and norms apart.
        The answer depends on shapes and dtypes only, so every rank takes the same path."""
        fused = getattr(self.reducer, "add_rms_norm", None)
        pushed = isinstance(t, Pushed)
        x = t.x if pushed else t
        if (not self.sharded or fused is None or residual is None
                or not self.reducer.fits_norm(x, residual, norm_weight)):
            return None
        normed, summed = fused(x, residual, norm_weight, eps, slot, pushed=pushed)
        return Normed(normed, summed, norm_weight)


UNSHARDED = Shard()

# How each checkpoint tensor is split, by the LayerWeights field it feeds: the dim (0: output
# rows, 1: input columns) or None for replicated. q, k, v (and their biases), gate and up are
# split one by one before they are stacked, so each rank's stack is [its q; its k; its v].
COLUMN_PARALLEL = 0  # q, k, v, gate, up and the qkv bias
ROW_PARALLEL = 1  # o, down
