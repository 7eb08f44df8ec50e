"""W8A16: the fp8 projection kernel, its e4m3 weight converted to the activation dtype in
registers (exact) and its per-channel scale applied to the finished sums. Launched by
kernels/linear_quant_triton.py (which picks the tile and the K split); reference:
kernels/linear_quant.py.

One-row batches dot on CUDA cores (BLOCK_M 1: a program's [BLOCK_N, BLOCK_K] products, reduced
once after the loop), more rows on tensor-core tiles. The prologue may compute the input in
the kernel: the RMSNorm of x + residual (NORM, in one pass over the row with ONE_PASS), or
silu(gate) * up (GATED), rounded as the separate kernels round (linear_tiles_triton); the
epilogue is quant_tiles_triton.finish_tile, as the int4 kernel's.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import linear_tiles_triton as tiles
from . import pdl
from . import quant_tiles_triton as qt


@triton.jit
def _x_tile(x_rows, r_rows, nw_ptr, K, k0, k_hi, m_ok, rstd, dtype: tl.constexpr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The input for K columns k0..: x, or silu(gate) * up (GATED), or the RMSNorm of
    (x + residual) (NORM), rounded as the separate kernels round (linear_tiles_triton)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tiles._input_tile(x_rows, r_rows, nw_ptr, K, ks, ks < k_hi, m_ok, rstd, dtype, NORM,
                             HAS_RES, GATED)


@triton.jit
def _rstd(x_rows, r_rows, sum_ptr, rm, K, eps, m_ok, writes_sum, dtype: tl.constexpr,
          NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """NORM: 1 / rms of each row of x + residual, in a pass over K before the first dot (every
    program needs the whole row; it is small and L2-resident), the program chosen by
    writes_sum storing x + residual as the new residual stream."""
    rstd = eps  # a placeholder unless NORM
    if NORM:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        sum_rows = sum_ptr + rm.to(tl.int64)[:, None] * K
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = m_ok[:, None] & (ks < K)[None, :]
            xf = tiles._summed_tile(x_rows, r_rows, sum_rows, ks, mask, writes_sum, dtype,
                                    HAS_RES).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt_rn(ss / K + eps)
    return rstd


@triton.jit
def _w8_tile(w_rows, k0, k_hi, n_ok, BLOCK_K: tl.constexpr):
    """The fp8 weight tile [BLOCK_N, BLOCK_K] as stored."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < k_hi)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, x, w, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """acc plus x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed. Tensor-core tiles
    (DOT) add finished [BLOCK_M, BLOCK_N] sums; one row (BLOCK_M 1) adds the
    [BLOCK_N, BLOCK_K] products, reduced once after the loop."""
    if DOT:
        if UPCAST:
            p = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            p = tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        p = w.to(tl.float32) * x.to(tl.float32)
    return acc + p


@triton.jit
def _w8_step(acc, ss, w, x_rows, r_rows, nw_ptr, sum_rows, K, k0, k_hi, m_ok, rstd, writes_sum,
             dtype: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
             GATED: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
             ONE_PASS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K block of fp8; ONE_PASS: the norm's input rounded once as (x + residual) * norm
    weight, its sums of squares added to ss, 1 / rms applied to the finished sums (as the bf16
    projection does, linear_triton.py): the row is read once instead of twice."""
    # one return after the branches: Triton compiles what follows a return inside an if
    if ONE_PASS:
        ks = k0 + tl.arange(0, BLOCK_K)
        x, part = tiles._unscaled_norm_tile(x_rows, r_rows, nw_ptr, sum_rows, ks, ks < k_hi,
                                            m_ok, writes_sum, dtype, HAS_RES)
        acc = _accumulate(acc, x, w, DOT, UPCAST)
        ss += part
    else:
        x = _x_tile(x_rows, r_rows, nw_ptr, K, k0, k_hi, m_ok, rstd, dtype, NORM, HAS_RES,
                    GATED, BLOCK_K)
        acc = _accumulate(acc, x, w, DOT, UPCAST)
    return acc, ss


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


# M is the batch: never specialise on it, or every new batch size would compile again. Under
# programmatic dependent launch (PDL, kernels/pdl.py) a program lets the next kernel launch,
# fetches its first weight tile (weights are never written during decode), and only then waits
# for the kernel before it, whose output x is.
@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                  res_ptr, g_ptr, ss_out_ptr, ss_in_ptr, pf_ptr, M, N, K, k_per_split, sx, sr,
                  sres, n_ss, pf_total, eps, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                  GATED: tl.constexpr, HAS_BIAS: tl.constexpr, RES_OUT: tl.constexpr,
                  NORM_OUT: tl.constexpr, ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr,
                  BLOCK_SS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                  UPCAST: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                  ONE_PASS: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """fp8 e4m3 weight [N, K], fp32 scale [N]: out = (x @ q.T) * scale, x through the
    prologue (_x_tile, or _w8_step's one-pass norm). The epilogue:
    quant_tiles_triton.finish_tile, as the int4 kernel's (its residual res, the next
    norm's weight nw); PF_LINES: the L2 hint (kernels/l2_prefetch.py) after the loop."""
    rm, rn, m_ok, n_ok, k_lo, k_hi, pid_n = qt.tile_ids(M, N, K, k_per_split, BLOCK_M,
                                                        BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    r_rows = r_ptr + rm.to(tl.int64)[:, None] * sr
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = _acc_zeros(BLOCK_M, BLOCK_N, BLOCK_K)
    k_start = k_lo
    if PDL:
        pdl.gdc_launch_dependents()
        w_first = _w8_tile(w_rows, k_lo, k_hi, n_ok, BLOCK_K)
        pdl.gdc_wait()
    # the first column block's program of the first K split stores the residual sum of its rows
    writes_sum = (pid_n == 0) & (tl.program_id(1) == 0)
    sum_rows = sum_ptr + rm.to(tl.int64)[:, None] * K
    rstd = eps
    if not ONE_PASS:
        rstd = _rstd(x_rows, r_rows, sum_ptr, rm, K, eps, m_ok, writes_sum, dtype, NORM,
                     HAS_RES, BLOCK_M, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # ONE_PASS: each row's sum of squares
    prologue = (x_rows, r_rows, nw_ptr, sum_rows, K)
    if PDL:
        acc, ss = _w8_step(acc, ss, w_first, *prologue, k_lo, k_hi, m_ok, rstd, writes_sum,
                           dtype, NORM, HAS_RES, GATED, DOT, UPCAST, ONE_PASS, BLOCK_K)
        k_start = k_lo + BLOCK_K
    if ROW_SCALE:
        ss_parts = tiles.load_row_ss(ss_in_ptr, n_ss, rm, m_ok, M, BLOCK_SS)
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        w = _w8_tile(w_rows, k0, k_hi, n_ok, BLOCK_K)
        acc, ss = _w8_step(acc, ss, w, *prologue, k0, k_hi, m_ok, rstd, writes_sum, dtype,
                           NORM, HAS_RES, GATED, DOT, UPCAST, ONE_PASS, BLOCK_K)
    tiles.warm_next(pf_ptr, pf_total, PF_LINES, PF_LINE)
    if BLOCK_M == 1:  # the row's products, reduced once
        acc = tl.sum(acc, axis=1)[None, :]
    if ONE_PASS:
        acc = acc * (1.0 / tl.sqrt_rn(ss / K + eps))[:, None]
    if ROW_SCALE:
        acc = acc * tiles.row_rstd(ss_parts, K, eps)[:, None]
    scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    qt.finish_tile(acc * scale[None, :], out_ptr, ws_ptr, cnt_ptr, b_ptr, res_ptr, nw_ptr,
                   g_ptr, ss_out_ptr, rm, rn, m_ok, n_ok, pid_n, M, N, sres, HAS_BIAS, RES_OUT,
                   NORM_OUT, SPLIT)
