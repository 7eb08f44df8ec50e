"""The quantized projections, PyTorch reference: dequantize the weight (kernels/quant.py) into
x's dtype, then the dense projection (with the norm or the activation before it, as
kernels/linear.py). The CPU runs them, and they are the oracles of the Triton W8A16 / W4A16
kernels (kernels/linear_quant_triton.py), which share their signatures."""
from __future__ import annotations

import torch
import torch.nn.functional as F

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
