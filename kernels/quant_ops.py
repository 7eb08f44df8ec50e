"""QuantizedOps: an op set whose projections also take a QuantizedWeight (kernels/quant.py).

A quantized projection is one more op: each projection of the base set is wrapped so that a
QuantizedWeight goes to the quantized ops (the references, or the Triton W8A16 / W4A16
kernels, which at one row take the norm before qkv and gate_up and the activation before
down into their prologue) and a dense weight to the base op as before. The residual add after
a quantized o or down is left to the next norm, as the plain composition of LayerOps does; a
dense weight in the same model (the LM head) keeps the base set's fusions. On a
tensor-parallel rank the quantized o and down return their partial sums for the all-reduce,
the residual passed on."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from . import Normed, Ops
from .quant import QuantizedWeight


def _quantized(weight) -> bool:
    return isinstance(weight, QuantizedWeight)


@dataclass(frozen=True)
class QuantizedOps:
    base: Ops
    qlinear: Callable  # (x, QuantizedWeight, bias) -> [M, N]
    # (x, residual or None, norm_weight, eps, QuantizedWeight, bias) -> (proj, x + residual)
    qnorm_linear: Callable
    qsilu_mul_linear: Callable  # (gate_up [M, 2I], QuantizedWeight, bias) -> [M, N]

    def linear(self, x, weight, bias=None):
        if _quantized(weight):
            return self.qlinear(x, weight, bias)
        return self.base.linear(x, weight, bias)

    def norm_linear(self, x, residual, norm_weight, eps, weight, bias=None, **kwargs):
        if not _quantized(weight):
            return self.base.norm_linear(x, residual, norm_weight, eps, weight, bias, **kwargs)
        if isinstance(x, Normed):  # a rank's input, normed by the all-reduce before it
            return self.qlinear(x.x, weight, bias), x.summed
        if hasattr(x, "h"):  # a Prenormed: a dense o or down before it (a checkpoint that
            x, residual = x.h, None  # left some layers dense) summed the stream already
        return self.qnorm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(self, gate_up, weight, bias=None):
        if _quantized(weight):
            return self.qsilu_mul_linear(gate_up, weight, bias)
        return self.base.silu_mul_linear(gate_up, weight, bias)

    def out_linear(self, x, weight, residual, next_norm=None, **kwargs):
        if _quantized(weight):  # the add goes to the next norm (or, on a rank, the all-reduce)
            return self.qlinear(x, weight), residual
        return self.base.out_linear(x, weight, residual, next_norm, **kwargs)

    def mlp(self, x, residual, norm_weight, eps, gate_up, down, next_norm=None, **kwargs):
        if not _quantized(down):
            return self.base.mlp(x, residual, norm_weight, eps, gate_up, down, next_norm,
                                 **kwargs)
        h, summed = self.norm_linear(x, residual, norm_weight, eps, gate_up)
        return self.silu_mul_linear(h, down), summed

    def for_rank(self, rank: int) -> Ops:
        return replace(self, base=self.base.for_rank(rank)).ops()

    def ops(self) -> Ops:
        b = self.base
        return replace(b, name=f"{b.name}-quantized", linear=self.linear,
                       norm_linear=self.norm_linear, silu_mul_linear=self.silu_mul_linear,
                       out_linear=None if b.out_linear is None else self.out_linear,
                       mlp=None if b.mlp is None else self.mlp,
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
                        partial(lq.silu_mul_linear_quant, t=t)).ops()
