"""W8A8 at decode batches: rows already in e4m3 with one scale each (kernels/
quant_rows_triton.py) times the fp8 weight on the fp8 tensor cores, the row and channel scales
in the epilogue. Reference: linear_fp8_rows._dequantized_mm; the same sums as
torch._scaled_mm, which runs above QuantLinearTuning.w8a8_triton_max_rows rows.

Why not torch._scaled_mm at 17-64 rows: cuBLASLt takes 128 x 128 tiles there, so a 4,096-
column projection (o, down) runs on 32 of an H100's 132 SMs. Here every program holds all the
rows (one tile of at most 64) and a narrow column block, and K is split until the programs fill
the GPU; the last program of a column block to finish adds the fp32 partials in split order
(deterministic).
On an H100 (tools/lab/w8a8_triton.py), llama-8b's four projections at 64 rows: 94 us against
torch._scaled_mm's 114.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import pdl
from .linear_fp8_rows import scaled_mm
from . import linear_tiles_triton as tiles
from . import quant_tiles_triton as qt
from .linear_triton import _split_k
from .tickets import ticket_counters
from .l2_prefetch import hint as l2_hint
from .quant import QuantizedWeight, stored
from .tuning import DEFAULT, QuantLinearTuning

# Triton's CPU interpreter has no fp8 dot: there the operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, pf_ptr, M, N,
                 K, k_per_split, pf_total, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                 PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """x [M, K] e4m3, xs [M] fp32, w [N, K] e4m3, ws [N] fp32: the program (column block,
    K split) over every row (M <= BLOCK_M) stores (x @ w.T) * xs * ws (+ bias), or under a
    split the last program of the column block to finish sums the fp32 partials
    (quant_tiles_triton.finish_tile); PF_LINES: the L2 hint (kernels/l2_prefetch.py) after
    the loop."""
    pdl.prologue(PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    tiles.warm_next(pf_ptr, pf_total, PF_LINES, PF_LINE)
    acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    qt.finish_tile(acc, out_ptr, part_ptr, cnt_ptr, b_ptr, out_ptr, out_ptr, out_ptr, out_ptr,
                    rm, rn, m_ok, n_ok, tl.program_id(0), M, N, 0, HAS_BIAS, False, False,
                    SPLIT)


# Every tile holds at least 64 rows, padded: Hopper's fp8 wgmma takes 64-row left operands, and
# for a smaller tile Triton runs the dot as fp16 mma.sync with both operands converted (sm_90
# PTX); the steps with either tile: docs/benchmarks.md (*Quantized decode*).
WGMMA_ROWS = 64


def _runs_here(q: torch.Tensor) -> bool:
    return q.is_cuda or _INTERPRET


def matmul_rows(q: torch.Tensor, scale: torch.Tensor, weight: QuantizedWeight,
                bias: torch.Tensor | None, out_dtype: torch.dtype,
                t: QuantLinearTuning = DEFAULT.quant_linear, split: int | None = None,
                prefetch=None, prefetch_bytes: int = 0) -> torch.Tensor:
    """Rows already quantized (q [M, K] e4m3, scale [M, 1] fp32) @ weight.T (+ bias) -> [M, N]
    in out_dtype: this kernel up to t.w8a8_triton_max_rows rows, torch._scaled_mm above.
    split: a forced K split (tests); prefetch, prefetch_bytes: the L2 hint for the next
    projection's weight (linear_quant_triton._launch)."""
    m, k = q.shape
    n = weight.shape[0]
    if m > t.w8a8_triton_max_rows or not _runs_here(q):
        return scaled_mm(q, scale, weight, bias, out_dtype)
    bk = t.w8a8_block_k
    few = m <= t.w8a8_few_rows_max
    wide = few or n >= t.wide_n
    warps = t.w8a8_few_rows_warps if few else t.w8a8_warps
    bn = t.w8a8_block_n_wide if wide else t.w8a8_block_n
    split = split or _split_k(triton.cdiv(n, bn), t.w8a8_programs, k, bk)
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=q.device) if split > 1 else out
    dependent = pdl.enabled(q)
    b = bias if bias is not None else out
    counters = ticket_counters(q.device, triton.cdiv(n, bn)) if split > 1 else out
    *pf, pf_meta = l2_hint(stored(prefetch), prefetch_bytes, triton.cdiv(n, bn) * split, out,
                           _INTERPRET)
    _w8a8_kernel[(triton.cdiv(n, bn), split)](
        q, scale, weight.data, weight.scale, b, out, part, counters, pf[0], m, n, k,
        k_per_split, pf[1], **pf_meta, HAS_BIAS=bias is not None, SPLIT=split,
        BLOCK_M=max(WGMMA_ROWS, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        STAGES=t.w8a8_stages, UPCAST=_INTERPRET, PDL=dependent, num_warps=warps,
        num_stages=t.w8a8_stages, launch_pdl=dependent)
    return out
