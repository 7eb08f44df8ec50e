"""The quantized projection, PyTorch reference: dequantize the weight (kernels/quant.py) into
x's dtype, then the dense projection. The CPU runs it, and it is the oracle of the Triton
W8A16 / W4A16 kernels (kernels/linear_quant_triton.py), which share its signature."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import QuantizedWeight, dequantize


def linear_quant_ref(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] quantized -> [M, N] in x's dtype."""
    return F.linear(x, dequantize(weight, x.dtype), bias)
