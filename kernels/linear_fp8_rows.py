"""fp8 weights at many rows (prefill chunks, mixed steps, batches past a few rows) on the fp8
tensor cores: the activations quantized per row (scale = max|x| / 448 over the row), then the
GEMM with the row scales and the weight's channel scales, torch._scaled_mm (cuBLASLt) here
and kernels/linear_w8a8_triton.py at decode batches, both checked against the references
below. W8A8: the activations lose precision too, unlike W8A16 (kernels/linear_quant_triton.py),
so it runs from QuantLinearTuning.fp8_scaled_mm_min_rows rows, where it measured faster. The
quantization is fused into the kernel that makes the input (kernels/quant_rows_triton.py: the
norm, silu * up); quantize_rows_ref here is its reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import silu_mul_ref
from .quant import FP8_MAX, QuantizedWeight
from .rmsnorm import add_rms_norm_ref, rms_norm_ref


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in e4m3, scale [M, 1] fp32): one scale per row, max|x| / 448 (1 for a zero
    row)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_rows_ref(x: torch.Tensor, residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                      gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual or x): the input through its prologue (the RMSNorm of x +
    residual, or silu(gate) * up when gated), then quantize_rows."""
    summed = x
    if gated:
        x = silu_mul_ref(x)
    if norm_weight is not None:
        if residual is not None:
            x, summed = add_rms_norm_ref(x, residual, norm_weight, eps)
        else:
            x = rms_norm_ref(x, norm_weight, eps)
    q, scale = quantize_rows(x)
    return q, scale, summed


def supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """cuBLASLt's fp8 GEMM wants dims in multiples of 16 and a row-major x."""
    n, k = weight.shape
    return (weight.format == "fp8" and x.dim() == 2 and x.shape[1] == k and k % 16 == 0
            and n % 16 == 0 and x.stride(-1) == 1)


def scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: QuantizedWeight,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows already quantized (q [M, K] e4m3, scale [M, 1]) @ weight.T (+ bias) -> [M, N]."""
    out = torch._scaled_mm(q, weight.data.t(), scale_a=scale, scale_b=weight.scale[None, :],
                           out_dtype=out_dtype)
    return out if bias is None else out + bias


def linear_fp8_rows(x: torch.Tensor, weight: QuantizedWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype, on the fp8 tensor cores, the rows
    quantized by the reference (tests, and devices without the Triton kernel)."""
    q, scale = quantize_rows(x)
    return scaled_mm(q, scale, weight, bias, x.dtype)


def _dequantized_mm(q: torch.Tensor, scale: torch.Tensor, weight: QuantizedWeight,
                    bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    w = weight.data.float() * weight.scale[:, None]
    return F.linear(q.float() * scale, w, None if bias is None else bias.float()).to(dtype)


def linear_fp8_rows_ref(x: torch.Tensor, weight: QuantizedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    xq, xs = quantize_rows(x)
    return _dequantized_mm(xq, xs, weight, bias, x.dtype)


def norm_linear_fp8_rows_ref(x: torch.Tensor, residual: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, weight: QuantizedWeight,
                             bias: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 after the norm (the quantized op set's norm_linear): (projection, x + residual)."""
    q, scale, summed = quantize_rows_ref(x, residual, norm_weight, eps)
    return _dequantized_mm(q, scale, weight, bias, x.dtype), summed


def silu_mul_linear_fp8_rows_ref(gate_up: torch.Tensor, weight: QuantizedWeight,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    q, scale, _ = quantize_rows_ref(gate_up, gated=True)
    return _dequantized_mm(q, scale, weight, bias, gate_up.dtype)
