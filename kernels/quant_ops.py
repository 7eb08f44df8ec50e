"""QuantizedOps: an op set whose projections also take a QuantizedWeight (kernels/quant.py).

A quantized projection is one more op: each projection of the base set is wrapped so that a
QuantizedWeight goes to the quantized ops (the references, or the Triton W8A16 / W4A16
kernels, which at one row take the norm before qkv and gate_up and the activation before
down into their prologue) and a dense weight to the base op as before.

Where the base set composes o and down with the residual stream (Ops.out_linear, Ops.mlp) and
the kernels take the rows, a quantized o or down adds the residual in its epilogue and begins
the next norm (a Prenormed, as the bf16 FusedOps), which the quantized qkv or gate_up after
it finishes: no norm kernel runs between two quantized projections. Otherwise the add is left
to the next norm. On a tensor-parallel rank the quantized o and down return their partial
sums for the all-reduce, the residual passed on. The Triton set's projections warm L2 with the
next projection's weight, as the dense ones do (kernels/l2_prefetch.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from . import Normed, Ops, Prenormed
from .quant import QuantizedWeight
from .weight_order import WeightOrder


def _quantized(weight) -> bool:
    return isinstance(weight, QuantizedWeight)


def _prenormed_by(x, norm_weight) -> bool:
    return isinstance(x, Prenormed) and x.norm_weight is norm_weight


@dataclass(frozen=True)
class QuantizedOps:
    base: Ops
    qlinear: Callable  # (x, QuantizedWeight, bias) -> [M, N]
    # (x, residual or None, norm_weight, eps, QuantizedWeight, bias) -> (proj, x + residual)
    qnorm_linear: Callable
    qsilu_mul_linear: Callable  # (gate_up [M, 2I], QuantizedWeight, bias) -> [M, N]
    # The epilogue-fused forms (the Triton sets; None: the plain composition):
    # (x, QuantizedWeight, residual, next_norm or None, gated) -> h + residual or a Prenormed
    qlinear_add: Callable | None = None
    # (Prenormed, eps, QuantizedWeight, bias) -> the projection of its norm
    qprenormed_linear: Callable | None = None
    # (x, QuantizedWeight, width) -> whether qlinear_add fuses the add for these rows (width 2:
    # x is [gate | up])
    qtakes_epilogue: Callable | None = None
    # The L2 hint (Triton sets): the model's weights in launch order, and how many bytes of
    # the next weight each quantized projection asks L2 for.
    order: WeightOrder | None = None
    prefetch_bytes: int = 0

    def _warm(self, weight) -> dict:
        if self.order is None or self.prefetch_bytes <= 0:
            return {}
        return dict(prefetch=self.order.next(weight), prefetch_bytes=self.prefetch_bytes)

    def link_weights(self, weights) -> None:
        if self.base.link_weights is not None:
            self.base.link_weights(weights)
        if self.order is not None:
            self.order.link(weights)

    def _adds(self, x, weight, width: int) -> bool:
        """Whether o or down adds the residual in its epilogue: not on a rank, and only where
        the kernel does (elsewhere the next norm's kernel adds it at no extra launch)."""
        return (self.qlinear_add is not None and not self.base.rank_set
                and self.qtakes_epilogue(x, weight, width))

    def linear(self, x, weight, bias=None):
        if _quantized(weight):
            return self.qlinear(x, weight, bias, **self._warm(weight))
        return self.base.linear(x, weight, bias)

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, **kwargs):
        if not _quantized(weight):
            return self.base.norm_linear(x, residual, norm_weight, eps, weight, bias, **kwargs)
        warm = self._warm(weight)
        if isinstance(x, Normed):  # a rank's input, normed by the all-reduce before it
            return self.qlinear(x.x, weight, bias, **warm), x.summed
        if _prenormed_by(x, norm_weight) and self.qprenormed_linear is not None:
            return self.qprenormed_linear(x, eps, weight, bias, **warm), x.h
        if isinstance(x, Prenormed):  # the stream summed already, by o or down before it
            x, residual = x.h, None
        return self.qnorm_linear(x, residual, norm_weight, eps, weight, bias, **warm)

    def silu_mul_linear(self, gate_up, weight, bias=None):
        if _quantized(weight):
            return self.qsilu_mul_linear(gate_up, weight, bias, **self._warm(weight))
        return self.base.silu_mul_linear(gate_up, weight, bias)

    def out_linear(self, x, weight, residual, next_norm=None, **kwargs):
        if not _quantized(weight):
            return self.base.out_linear(x, weight, residual, next_norm, **kwargs)
        if residual is not None and self._adds(x, weight, 1):
            return self.qlinear_add(x, weight, residual, next_norm, False,
                                    **self._warm(weight)), None
        # the add goes to the next norm (or, on a rank, the all-reduce)
        return self.qlinear(x, weight, **self._warm(weight)), residual

    def mlp(self, x, residual, norm_weight, eps, gate_up, down, next_norm=None, **kwargs):
        if not _quantized(down):
            return self.base.mlp(x, residual, norm_weight, eps, gate_up, down, next_norm,
                                 **kwargs)
        h, summed = self.norm_linear(x, residual, norm_weight, eps, gate_up)
        if self._adds(h, down, 2):
            return self.qlinear_add(h, down, summed, next_norm, True, **self._warm(down)), None
        return self.silu_mul_linear(h, down), summed

    def for_rank(self, rank: int) -> Ops:
        return replace(self, base=self.base.for_rank(rank)).ops()

    def ops(self) -> Ops:
        b = self.base
        return replace(b, name=f"{b.name}-quantized", linear=self.linear,
                       norm_linear=self.norm_linear, silu_mul_linear=self.silu_mul_linear,
                       out_linear=None if b.out_linear is None else self.out_linear,
                       mlp=None if b.mlp is None else self.mlp,
                       link_weights=self.link_weights,
                       for_rank=None if b.for_rank is None else self.for_rank)


def quantized_reference_ops(base: Ops) -> Ops:
    """base with quantized projections by the PyTorch references (the CPU, the oracle)."""
    from . import linear_quant as lq

    return QuantizedOps(base, lq.linear_quant_ref, lq.norm_linear_quant_ref,
                        lq.silu_mul_linear_quant_ref).ops()


def quantized_triton_ops(base: Ops, tuning) -> Ops:
    """base with quantized projections by the Triton W8A16 / W4A16 kernels (CUDA; the
    interpreter in tests), launched from `tuning`'s table."""
    from . import linear_quant_triton as lq

    t = tuning.quant_linear
    return QuantizedOps(base, partial(lq.linear_quant, t=t), partial(lq.norm_linear_quant, t=t),
                        partial(lq.silu_mul_linear_quant, t=t),
                        partial(lq.linear_quant_add, t=t),
                        partial(lq.prenormed_linear_quant, t=t),
                        partial(lq.takes_epilogue, t=t), WeightOrder(),
                        t.l2_prefetch_bytes).ops()
