"""The op sets of projections="auto" and batch_invariant=True (CUDA), one class each, built on
TRITON_OPS (kernels/triton_ops.py) with a tuning table (kernels/tuning.py):

- AutoProjections: Triton for batches of up to auto_max_rows rows (the norm and silu * mul
  fused into the projections' prologue at one row), the LM head on Triton up to wide_max_rows,
  cuBLAS elsewhere;
- FusedOps: on top of it, from fused_min_rows to fused_max_rows rows, the residual add and the
  activation moved into the projections' epilogues (out_linear, mlp); for a tensor-parallel
  rank (for_rank), partial sums sent to the peers from the epilogue;
- invariant_ops: per-row results that do not depend on the batch.

`ops()` gives each as the `Ops` the model calls. Every function keeps the signature and
semantics of the reference it replaces (kernels/linear.py)."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from . import Normed, Ops, Prenormed
from . import linear_fused_triton, linear_invariant_triton, linear_triton
from .attention_decode_triton import decode_attention_invariant
from .attention_prefill_triton import prefill_attention_invariant
from .tuning import LinearTuning, Tuning
from .weight_order import WeightOrder


def warm_next(t: LinearTuning, order: WeightOrder, weight: torch.Tensor, kind: str) -> dict:
    """The prefetch arguments of a projection of `kind`: the next projection's weight, and how
    much of it to warm in L2 (tuning.L2Prefetch)."""
    return dict(prefetch=order.next(weight), prefetch_bytes=t.l2_prefetch.bytes_for(kind))


class AutoProjections:
    """linear, norm_linear and silu_mul_linear of projections="auto" (see the module
    docstring). A projection of a one-row batch warms L2 with the next projection's weight."""

    def __init__(self, t: LinearTuning, order: WeightOrder):
        self.t, self.order = t, order

    def _warm_one_row(self, x, weight) -> dict:
        return warm_next(self.t, self.order, weight, "one_row") if x.shape[0] == 1 else {}

    def linear(self, x, weight, bias=None):
        return linear_triton.linear(x, weight, bias, max_rows=self.t.auto_max_rows, t=self.t,
                                    **self._warm_one_row(x, weight))

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        t = self.t
        if (weight.shape[0] >= t.wide_weight_rows
                and t.auto_max_rows < x.shape[0] <= t.wide_max_rows):
            normed, summed = linear_triton._norm(x, residual, norm_weight, eps)
            return linear_triton.linear(normed, weight, bias, max_rows=t.wide_max_rows,
                                        t=t), summed
        return linear_triton.norm_linear(x, residual, norm_weight, eps, weight, bias,
                                         max_rows=t.auto_max_rows, t=t,
                                         **self._warm_one_row(x, weight))

    def silu_mul_linear(self, gate_up, weight, bias=None):
        return linear_triton.silu_mul_linear(gate_up, weight, bias,
                                             max_rows=self.t.auto_max_rows, t=self.t,
                                             **self._warm_one_row(gate_up, weight))

    def ops(self, base: Ops) -> Ops:
        return replace(base, name="triton-auto", linear=self.linear,
                       norm_linear=self.norm_linear, silu_mul_linear=self.silu_mul_linear,
                       link_weights=self.order.link)


def _plain(x):
    """The stream as a tensor, whether or not a projection began its next norm."""
    return x.h if isinstance(x, Prenormed) else x


def _prenormed_by(x, norm_weight) -> bool:
    return isinstance(x, Prenormed) and x.norm_weight is norm_weight


class FusedOps:
    """base with, for batches of t.fused_min_rows..t.fused_max_rows rows, the residual add and
    the activation moved into the projections' epilogues (tensor-core Triton kernels): o and
    down add the residual stream to their output and begin the next norm (Prenormed), which
    the projection after it finishes; gate_up computes silu(gate) * up; a small qkv projection
    (t.fused_qkv_max_elements) runs on Triton too, and the attention after it may then fetch
    its first KV tile before its PDL wait. A layer is then eight launches instead of nine, and
    the activation makes no extra round trip through memory. Other row counts run as in base.

    rank: the set for one tensor-parallel rank, where o and down return partial sums that the
    model all-reduces, the residual passed on (the all-reduce adds it, or else the next norm),
    and norm_linear and mlp may receive a Normed (its norm done by that all-reduce); the next
    norm is not begun (a partial sum's norm is no part of the whole's). A rank's qkv runs on
    Triton up to t.rank_qkv_max_elements instead. Given push=, a rank's o and down on Triton
    send their partial sums to the peers from their epilogue (a Pushed comes back); given
    gather=, a rank's LM head on Triton returns the whole logits, the peers' columns landed by
    their LM heads (kernels/gather_triton.py)."""

    def __init__(self, base: Ops, t: LinearTuning, order: WeightOrder,
                 rank: int | None = None):
        self.base, self.t, self.order, self.rank = base, t, order, rank
        # Whether the last qkv projection ran on Triton: a layer's attention follows its qkv
        # projection (the only norm_linear here besides the LM head) and prefetches after
        # Triton; a wrong guess costs speed only.
        self.last_qkv_triton = False

    def fused(self, x) -> bool:
        return self.t.fused_min_rows <= x.shape[0] <= self.t.fused_max_rows

    def _config(self, x, weight, kind: str):
        return linear_fused_triton.pick_fused_config(x.shape[0], *weight.shape, kind, self.t)

    def _qkv(self, normed, weight, bias):
        """A fused batch's qkv projection on Triton, its input normed already."""
        return linear_triton.linear(normed, weight, bias, self._config(normed, weight, "qkv"),
                                    max_rows=self.t.fused_max_rows, t=self.t,
                                    **warm_next(self.t, self.order, weight, "qkv"))

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, gather=None):
        base, t = self.base, self.t
        if gather is not None and self.fused(x) and bias is None and not isinstance(x, Normed):
            # a rank's LM head, gathering the logits in its epilogue where the kernel can
            normed, summed = linear_triton._norm(_plain(x), residual, norm_weight, eps)
            logits = linear_fused_triton.linear_gathered(normed, weight, gather,
                                                         max_rows=t.fused_max_rows, t=t)
            if logits is not None:
                return logits, summed
            return base.linear(normed, weight), summed
        if isinstance(x, Normed):  # a rank's qkv input, normed by the all-reduce before it
            self.last_qkv_triton = (self.fused(x)
                                    and weight.numel() <= t.rank_qkv_max_elements)
            if not self.last_qkv_triton:
                return base.linear(x.x, weight, bias), x.summed
            return self._qkv(x.x, weight, bias), x.summed
        if weight.shape[0] >= t.wide_weight_rows:  # the LM head
            if not self.fused(x):
                return base.norm_linear(_plain(x), residual, norm_weight, eps, weight, bias)
            normed, summed = linear_triton._norm(_plain(x), residual, norm_weight, eps)
            config = self._config(x, weight, "lm_head")
            return linear_triton.linear(normed, weight, bias, config,
                                        max_rows=t.fused_max_rows, t=t), summed
        self.last_qkv_triton = self.fused(x) and weight.numel() <= t.fused_qkv_max_elements
        if self.last_qkv_triton and _prenormed_by(x, norm_weight):
            return linear_fused_triton.prenormed_linear(
                x, eps, weight, bias, self._config(x, weight, "qkv"), max_rows=t.fused_max_rows,
                t=t, **warm_next(self.t, self.order, weight, "qkv")), x.h
        x = _plain(x)
        if not self.last_qkv_triton:
            return base.norm_linear(x, residual, norm_weight, eps, weight, bias)
        normed, summed = linear_triton._norm(x, residual, norm_weight, eps)
        return self._qkv(normed, weight, bias), summed

    def rope_decode_attention(self, q, *args, **kwargs):
        if self.fused(q) and self.last_qkv_triton:
            return self.base.rope_decode_attention(q, *args, prefetch=True, **kwargs)
        return self.base.rope_decode_attention(q, *args, **kwargs)

    def _add(self, x, weight, residual, next_norm, kind: str, push=None):
        """x's projection plus the residual; a rank's partial sum alone (sent to the peers
        from the epilogue where push says and the kernel can)."""
        t = self.t
        warm = warm_next(t, self.order, weight, kind)
        if self.rank is not None:
            return linear_fused_triton.linear_partial(x, weight, max_rows=t.fused_max_rows,
                                                      push=push, t=t, **warm)
        return linear_fused_triton.linear_add(x, weight, residual, max_rows=t.fused_max_rows,
                                              next_norm=next_norm, t=t, **warm)

    def out_linear(self, x, weight, residual, next_norm=None, push=None):
        if not self.fused(x) or residual is None:
            return self.base.linear(x, weight), residual
        if self.rank is not None:  # the residual passes on to the all-reduce or the next norm
            return self._add(x, weight, None, None, "o", push), residual
        return self._add(x, weight, residual, next_norm, "o"), None

    def mlp(self, x, residual, norm_weight, eps, gate_up, down, next_norm=None, push=None):
        base, t = self.base, self.t
        normed_in = isinstance(x, Normed)  # a rank's input, normed by the all-reduce before it
        if not self.fused(x):
            if normed_in:
                return base.silu_mul_linear(base.linear(x.x, gate_up), down), x.summed
            h, summed = base.norm_linear(_plain(x), residual, norm_weight, eps, gate_up)
            return base.silu_mul_linear(h, down), summed
        warm = warm_next(t, self.order, gate_up, "gate_up")
        if _prenormed_by(x, norm_weight):
            act = linear_fused_triton.prenormed_linear(x, eps, gate_up, silu_out=True,
                                                       max_rows=t.fused_max_rows, t=t, **warm)
            summed = x.h
        else:
            normed, summed = ((x.x, x.summed) if normed_in else
                              linear_triton._norm(_plain(x), residual, norm_weight, eps))
            act = linear_fused_triton.linear_silu(normed, gate_up, max_rows=t.fused_max_rows,
                                                  t=t, **warm)
        if self.rank is not None:
            return self._add(act, down, None, None, "down", push), summed
        # the next layer's qkv takes a Prenormed only on Triton (this layer's tells)
        return self._add(act, down, summed, next_norm if self.last_qkv_triton else None,
                         "down"), None

    def for_rank(self, rank: int) -> Ops:
        return FusedOps(self.base, self.t, self.order, rank).ops()

    def ops(self) -> Ops:
        t, rank = self.t, self.rank
        name = (f"{self.base.name}-fused{t.fused_min_rows}-{t.fused_max_rows}"
                + ("" if rank is None else f"-rank{rank}"))
        return replace(self.base, name=name, norm_linear=self.norm_linear,
                       link_weights=self.order.link,
                       out_linear=self.out_linear, mlp=self.mlp,
                       rope_decode_attention=(None if self.base.rope_decode_attention is None
                                              else self.rope_decode_attention),
                       for_rank=None if rank is not None else self.for_rank,
                       rank_set=rank is not None)


def auto_ops(base: Ops, t: LinearTuning) -> Ops:
    """projections="auto": AutoProjections, and FusedOps over it, sharing one WeightOrder."""
    order = WeightOrder()
    return FusedOps(AutoProjections(t, order).ops(base), t, order).ops()


def invariant_ops(base: Ops, tuning: Tuning) -> Ops:
    """Per-row results that do not depend on the batch (EngineConfig.batch_invariant): what
    lets a bf16 draft that equals the target be accepted every time."""
    li, t, a = linear_invariant_triton, tuning.linear, tuning.attention
    return replace(base, name="triton-batch-invariant",
                   linear=partial(li.linear_invariant, t=t),
                   norm_linear=partial(li.norm_linear_invariant, t=t),
                   silu_mul_linear=partial(li.silu_mul_linear_invariant, t=t),
                   decode_attention=partial(decode_attention_invariant, tuning=a),
                   prefill_attention=partial(prefill_attention_invariant, tuning=a),
                   # the separate rope_write_kv: prefill writes KV with it, and a recompute
                   # must rebuild those bits exactly
                   rope_decode_attention=None, all_reduce_norm=False)
