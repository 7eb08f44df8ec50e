"""The quantized projections, PyTorch reference: dequantize the weight (kernels/quant.py) into
x's dtype, then the dense projection (with the norm or the activation before it, as
kernels/linear.py; or the residual add and the next norm begun after it). The CPU runs them,
and they are the oracles of the Triton W8A16 / W4A16 kernels (kernels/linear_quant_triton.py),
which share their signatures."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import Prenormed
from .activation import silu_mul_ref
from .linear import norm_linear_ref
from .quant import QuantizedWeight, dequantize


def linear_quant_ref(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] quantized -> [M, N] in x's dtype."""
    return F.linear(x, dequantize(weight, x.dtype), bias)


def norm_linear_quant_ref(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: QuantizedWeight,
                          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual), as kernels/linear.py norm_linear_ref."""
    return norm_linear_ref(x, residual, norm_weight, eps, dequantize(weight, x.dtype), bias)


def silu_mul_linear_quant_ref(gate_up: torch.Tensor, weight: QuantizedWeight,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up); gate_up: [M, 2 * I], gate first."""
    return linear_quant_ref(silu_mul_ref(gate_up), weight, bias)


def linear_quant_add_ref(x: torch.Tensor, weight: QuantizedWeight, residual: torch.Tensor,
                         next_norm: torch.Tensor | None = None,
                         gated: bool = False) -> torch.Tensor | Prenormed:
    """The projection of x (of silu(gate) * up when gated) rounded to x's dtype, plus the
    residual in fp32, rounded; with next_norm, that sum h as a Prenormed: g = h * next_norm,
    rounded, and each row's sum of squares as one tile, ss [1, M]."""
    h = silu_mul_linear_quant_ref(x, weight) if gated else linear_quant_ref(x, weight)
    h = (h.float() + residual.float()).to(x.dtype)
    if next_norm is None:
        return h
    hf = h.float()
    return Prenormed(h, (hf * next_norm.float()).to(x.dtype), hf.pow(2).sum(1)[None],
                     next_norm)


def prenormed_linear_quant_ref(p: Prenormed, eps: float, weight: QuantizedWeight,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """The projection of rms_norm(p.h) by p.norm_weight: what a Prenormed stands for."""
    return norm_linear_quant_ref(p.h, None, p.norm_weight, eps, weight, bias)[0]
