"""An fp8 projection's input, quantized per row in the kernel that makes it: x, or the RMSNorm
of x + residual, or silu(gate) * up, then scale = max|row| / 448 and the row / scale in e4m3
(W8A8: kernels/linear_w8a8_triton.py multiplies, or torch._scaled_mm past 64 rows).
Reference: linear_fp8_rows.quantize_rows_ref (same signature and rounding points).

Why fused: quantizing in PyTorch took 23 us a projection on an H100 (seven kernels over the
row), more than the fp8 GEMM it feeds at 64 rows. From more than one row the norm and the
activation already run as kernels of their own (QuantLinearTuning.fuse_max_rows); writing the
fp8 row and its scale there instead of the bf16 row costs nothing more, and only o, whose input
comes from attention, pays a pass of its own.

One program holds a whole row in registers (at most max_row elements, else the reference): the
amax needs all of it before the first element is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import linear_tiles_triton as tiles
from . import pdl

MAX_ROW = 32768  # elements a program holds (llama-70b's down projection takes 28,672)


def _new(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _quant_rows_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, q_ptr, s_ptr, K, sx, sr, eps,
                       NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program r: row r through the prologue (the projections' own tile functions, so rounded
    as the separate norm and activation kernels round), then quantized."""
    pdl.prologue(PDL)
    rm = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # one row, as a [1] tile
    m_ok = rm >= 0
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    dtype = sum_ptr.dtype.element_ty  # x's dtype
    x_rows, r_rows = x_ptr + rm[:, None] * sx, r_ptr + rm[:, None] * sr
    if NORM:  # x + residual stored as the new residual stream, then normed from registers
        summed = tiles._summed_tile(x_rows, r_rows, sum_ptr + rm[:, None] * K, ks,
                                    m_ok[:, None] & k_ok[None, :], True, dtype, HAS_RES)
        sf = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(sf * sf, axis=1) / K + eps)
        xf = tiles.normed_tile(summed, nw_ptr, ks, k_ok, rstd, dtype).to(tl.float32)
    else:
        xf = tiles._input_tile(x_rows, r_rows, nw_ptr, K, ks, k_ok, m_ok, eps, dtype, False,
                               HAS_RES, GATED).to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    scale = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)  # 448: quant.FP8_MAX
    q = tl.clamp(tl.div_rn(xf, scale[:, None]), -448.0, 448.0)
    tl.store(q_ptr + rm[:, None] * K + ks[None, :], q.to(tl.float8e4nv), mask=k_ok[None, :])
    tl.store(s_ptr + rm, scale)


def supported(x: torch.Tensor, gated: bool = False) -> bool:
    width = x.shape[-1] // 2 if gated else x.shape[-1]
    return (x.dim() == 2 and 0 < width <= MAX_ROW and x.stride(-1) == 1
            and x.dtype in (torch.bfloat16, torch.float16))


def quantize_rows(x: torch.Tensor, residual: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                  gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scale [M, 1] fp32, x + residual or x): the input through its prologue
    (the RMSNorm of x + residual by norm_weight, or silu(gate) * up when gated), quantized
    per row. x: [M, K], or [M, 2K] when gated."""
    m = x.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    q = _new((m, k), torch.float8_e4m3fn, x.device)
    scale = _new((m, 1), torch.float32, x.device)
    summed = _new((m, k), x.dtype, x.device) if residual is not None else x
    if m == 0:
        return q, scale, summed
    block = triton.next_power_of_2(k)
    warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    r = residual if residual is not None else x
    dependent = pdl.enabled(x)
    _quant_rows_kernel[(m,)](x, r, norm_weight if norm_weight is not None else x, summed, q,
                             scale, k, x.stride(0), r.stride(0), eps,
                             NORM=norm_weight is not None, HAS_RES=residual is not None,
                             GATED=gated, BLOCK_K=block, PDL=dependent, num_warps=warps,
                             launch_pdl=dependent)
    return q, scale, summed
