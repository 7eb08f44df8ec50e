"""fp8 weights at many rows (prefill chunks, mixed steps, large batches) on the fp8 tensor
cores: the activations quantized per token (scale = max|x| / 448 over the row) and
torch._scaled_mm (cuBLASLt) with the row scales and the weight's channel scales. W8A8: the
activations lose precision too, unlike W8A16 (kernels/linear_quant_triton.py), so it is used
from QuantLinearTuning.fp8_scaled_mm_min_rows rows only where measurement says it pays (0, the
shipped value: never). Reference: quantize x the same way, dequantize both, F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import FP8_MAX, QuantizedWeight


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in e4m3, scale [M, 1] fp32): one scale per row, max|x| / 448 (1 for a zero
    row)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """cuBLASLt's fp8 GEMM wants dims in multiples of 16 and a row-major x."""
    n, k = weight.shape
    return (weight.format == "fp8" and x.dim() == 2 and x.shape[1] == k and k % 16 == 0
            and n % 16 == 0 and x.stride(-1) == 1)


def linear_fp8_rows(x: torch.Tensor, weight: QuantizedWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, on the fp8 tensor cores."""
    xq, xs = quantize_rows(x)
    out = torch._scaled_mm(xq, weight.data.t(), scale_a=xs, scale_b=weight.scale[None, :],
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def linear_fp8_rows_ref(x: torch.Tensor, weight: QuantizedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    xq, xs = quantize_rows(x)
    w = weight.data.float() * weight.scale[:, None]
    return F.linear(xq.float() * xs, w, None if bias is None else bias.float()).to(x.dtype)
