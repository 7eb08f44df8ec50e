"""A quantized weight's dense copy in one pass (reference: kernels/quant.py dequantize, same
signature): each element read as stored and written once in the activation dtype. Rows above
QuantLinearTuning.max_rows (prefill chunks) run the dense GEMM on this copy; dequantizing with
torch ops took several passes over fp32 temporaries of the whole weight."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import QuantizedWeight
from .tuning import DEFAULT, QuantLinearTuning


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, ssn, ssg, szn, szg, FP8: tl.constexpr,
                    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Program (column block, row block): fp8 q * scale[n], or int4 (q - zero) * scale[n, g]
    (stored as q + 8 in plane order: column 16j + e of a 64-column block at nibble j of half
    e of the block, kernels/quant.py), rounded once to out's dtype."""
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    mask = n_ok[:, None] & (ks < K)[None, :]
    rows = rn.to(tl.int64)[:, None]
    if FP8:
        q = tl.load(w_ptr + rows * K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0)[:, None]
    else:
        half = (ks // 64) * 16 + ks % 16
        shift = (half % 2) * 16 + (ks % 64 // 16) * 4
        words = tl.load(w_ptr + rows * (K // 8) + (half // 2)[None, :], mask=mask, other=0)
        q = ((words >> shift[None, :]) & 0xF) - 8
        g = (ks // GROUP)[None, :]
        scale = tl.load(s_ptr + rows * ssn + g * ssg, mask=mask, other=0.0)
        if HAS_ZERO:
            q = q - tl.load(z_ptr + rows * szn + g * szg, mask=mask, other=0).to(tl.int32)
        q = q.to(tl.float32)
    tl.store(out_ptr + rows * K + ks[None, :], (q * scale).to(out_ptr.dtype.element_ty),
             mask=mask)


def dequantize(w: QuantizedWeight, dtype: torch.dtype | None = None,
               t: QuantLinearTuning = DEFAULT.quant_linear) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (default the activation dtype)."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype or w.out_dtype, device=w.device)
    bn, bk = t.dequant_block_n, t.dequant_block_k
    z = w.zero if w.zero is not None else w.scale
    strides = (*w.scale.stride(), *z.stride()) if w.format == "int4" else (1, 0, 1, 0)
    _dequant_kernel[(triton.cdiv(k, bk), triton.cdiv(n, bn))](
        w.data, w.scale, z, out, n, k, *strides, FP8=w.format == "fp8", GROUP=w.group_size or 1,
        HAS_ZERO=w.zero is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out
