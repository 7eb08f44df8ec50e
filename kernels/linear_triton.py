"""Triton projections for the small row counts of decode (M <= 64), optionally with the RMSNorm
(and the residual add before it) or the MLP's silu * mul folded into the prologue; and a
batch-invariant variant for any row count. Reference: kernels/linear.py.

Why: at decode the projections are weight streaming, and cuBLAS runs the small ones well below
copy bandwidth at M = 1 (about 54% for llama-1b's qkv and o, see docs/benchmarks.md). Each
program owns BLOCK_N output columns, walks K in BLOCK_K steps and reads every weight byte once;
when N / BLOCK_N programs are too few to keep HBM busy, K is split over a second grid axis and a
small kernel sums the fp32 partials in a fixed order (deterministic, no atomics).

Numerics: bf16/fp16 only (fp32 goes to torch: tensor-core dots would round it to tf32). Given
one config, a row's result does not depend on M or on the other rows (its sum runs over the same
K blocks in the same order); pick_config varies the config with M, invariant_config does not.
The fused norm runs in one pass (ONE_PASS) and rounds differently from kernels/rmsnorm.py: the
input is rounded once, as (x + residual) * norm weight, and the 1 / rms factor scales the fp32
dot products, where the separate kernel rounds the normalised row and then its product with the
weight; the results agree within the dtype's reduction tolerance, not bitwise. Under split K no
program sees the whole row, and a mean-square pass comes first (two-pass), keeping rmsnorm.py's
rounding points, with the mean square summed in BLOCK_K pieces.
"""
from __future__ import annotations

import os
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl
from .all_reduce_triton import Push, pair_words, push_words
from .gather_triton import Landing, land_tile, wait_and_place
from .l2_prefetch import LINE_BYTES, lines_per_program, prefetch_l2
from .activation_triton import silu_mul
from .norm_rope_triton import add_rms_norm, rms_norm
from .tuning import DEFAULT, LinearConfig, LinearTuning

__all__ = ["LinearConfig", "linear", "norm_linear", "silu_mul_linear", "pick_config"]

# Triton's CPU interpreter gets bf16 tl.dot wrong; there the operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET_C = tl.constexpr(_INTERPRET)
_TUNING = DEFAULT.linear  # what a caller that passes no table gets


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests replace it to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


# M is the batch: never specialise on it, or every new batch size would compile again.
@triton.jit
def _input_tile(x_rows, r_rows, nw_ptr, K, ks, k_ok, m_ok, rstd, dtype: tl.constexpr,
                NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr):
    """The projection's input for K columns ks: x, or silu(gate) * up, or the RMSNorm of
    (x + residual), rounded like the separate kernels would."""
    xv = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if GATED:
        # x holds [gate | up] (2K wide): the input is silu(gate) * up, rounded like
        # kernels/activation_triton.py (silu to the dtype, then the product).
        up = tl.load(x_rows + K + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        g = xv.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype)
        xv = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
    if NORM:
        if HAS_RES:
            rv = tl.load(r_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(dtype)
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
        y = (xv.to(tl.float32) * rstd[:, None]).to(dtype)
        xv = (y.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)
    return xv


@triton.jit
def _unscaled_norm_tile(x_rows, r_rows, nw_ptr, sum_rows, ks, k_ok, m_ok, writes_sum,
                        dtype: tl.constexpr, HAS_RES: tl.constexpr):
    """One-pass norm (ONE_PASS): the input tile as (x + residual) * norm weight, rounded once,
    and the tile's share of each row's sum of squares. The 1 / rms factor is applied to the
    finished dot products, so the row is read once instead of twice (a mean-square pass, then
    the loop). One program (writes_sum) stores the residual sum."""
    xf = _summed_tile(x_rows, r_rows, sum_rows, ks, m_ok[:, None] & k_ok[None, :], writes_sum,
                      dtype, HAS_RES).to(tl.float32)
    nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
    return (xf * nw.to(tl.float32)[None, :]).to(dtype), tl.sum(xf * xf, axis=1)


@triton.jit
def _summed_tile(x_rows, r_rows, sum_rows, ks, mask, writes_sum, dtype: tl.constexpr,
                 HAS_RES: tl.constexpr):
    """x + residual for K columns ks, rounded to the dtype (x alone without a residual); the
    program chosen by writes_sum stores it out as the new residual stream."""
    xv = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    if HAS_RES:
        rv = tl.load(r_rows + ks[None, :], mask=mask, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(dtype)
        if writes_sum:
            tl.store(sum_rows + ks[None, :], xv, mask=mask)
    return xv


@triton.jit
def _accumulate(acc, xv, wv, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    if BLOCK_M == 1:  # CUDA cores: [BLOCK_N, BLOCK_K] products, summed over K at the end
        acc += wv.to(tl.float32) * xv.to(tl.float32)
    elif UPCAST:
        acc += tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(xv, tl.trans(wv))
    return acc


@triton.jit
def _step(acc, acc_up, ss, wv, w_up, x_rows, r_rows, nw_ptr, sum_rows, K, ks, k_ok, m_ok, rstd,
          writes_sum, dtype: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
          GATED: tl.constexpr, ONE_PASS: tl.constexpr, SILU_OUT: tl.constexpr,
          BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """One K block: the input tile for columns ks times the weight tile wv, added to acc (and
    with SILU_OUT times the up projection's tile w_up, added to acc_up; with ONE_PASS the
    tile's sums of squares added to ss)."""
    if ONE_PASS:
        xv, part = _unscaled_norm_tile(x_rows, r_rows, nw_ptr, sum_rows, ks, k_ok, m_ok,
                                       writes_sum, dtype, HAS_RES)
        ss += part
    else:
        xv = _input_tile(x_rows, r_rows, nw_ptr, K, ks, k_ok, m_ok, rstd, dtype, NORM, HAS_RES,
                         GATED)
    if SILU_OUT:
        acc_up = _accumulate(acc_up, xv, w_up, BLOCK_M, UPCAST)
    return _accumulate(acc, xv, wv, BLOCK_M, UPCAST), acc_up, ss


# M is the batch: never specialise on it, or every new batch size would compile again.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, ws_ptr, g_ptr, ss_ptr,
                   pf_ptr, push_ptrs, land_ptrs, count_ptrs, M, N, K, k_per_split, eps, sx,
                   sr, n_ss, pf_total, push_slot_words, push_box_words, land_box_elems,
                   NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ONE_PASS: tl.constexpr, SILU_OUT: tl.constexpr,
                   RES_OUT: tl.constexpr, NORM_OUT: tl.constexpr, ROW_SCALE: tl.constexpr,
                   BLOCK_SS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                   PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
                   PUSH: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                   GATHER: tl.constexpr):
    # Row blocks vary fastest: the row blocks of one column block run together and share its
    # weight tile through L2 instead of each streaming it from HBM.
    # SILU_OUT: the weight is [gate | up] (2N rows) and the output silu(gate) * up, N wide; each
    # program streams the gate rows of its columns and the matching up rows, so the activation
    # is an epilogue (no program recomputes another's). RES_OUT: the residual stream r (M x N)
    # is added to the output in the epilogue (HAS_RES, the add in the prologue, is then off).
    # NORM_OUT and ROW_SCALE split the next RMSNorm between two projections
    # (linear_fused_triton.Prenormed). PUSH: the output tile also goes to the peers as this
    # rank's words of an all-reduce (kernels/all_reduce_triton.Push). GATHER: the output is
    # the whole [M, WORLD * N] of which this rank (RANK of WORLD) computes its N
    # columns, the tile also landing in the peers' zones (kernels/gather_triton.py).
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % m_blocks
    pid_n = tl.program_id(0) // m_blocks
    pid_k = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    r_rows = r_ptr + rm.to(tl.int64)[:, None] * sr
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    w_up_rows = w_ptr + (rn + N).to(tl.int64)[:, None] * K  # SILU_OUT only
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    k_start = k_lo
    if PDL:
        # Launched as a programmatic dependent (kernels/pdl.py): this program may run before
        # the previous kernel has finished. Let the next kernel launch as early, fetch the
        # first weight tile (weights are never written during decode), and only then wait:
        # nothing produced by an earlier kernel is read, and nothing written, before gdc_wait.
        pdl.gdc_launch_dependents()
        ks0 = k_lo + rk
        first_ok = n_ok[:, None] & (ks0 < k_hi)[None, :]
        w_first = tl.load(w_rows + ks0[None, :], mask=first_ok, other=0.0)
        w_up_first = w_first
        if SILU_OUT:
            w_up_first = tl.load(w_up_rows + ks0[None, :], mask=first_ok, other=0.0)
        pdl.gdc_wait()
        k_start = k_lo + BLOCK_K

    rstd = eps  # a placeholder unless NORM
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # ONE_PASS: each row's sum of squares
    # one program stores the residual sum (x + residual) of its rows
    writes_sum = (pid_n == 0) & (pid_k == 0)
    sum_rows = sum_ptr + rm.to(tl.int64)[:, None] * K
    if NORM and not ONE_PASS:
        # Every program needs the whole row's mean square before its first dot (split K, or
        # the two-pass rounding): one pass over K of the (small, L2-resident) input.
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            xf = _summed_tile(x_rows, r_rows, sum_rows, ks, m_ok[:, None] & (ks < K)[None, :],
                              writes_sum, dtype, HAS_RES).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt_rn(ss / K + eps)

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc  # SILU_OUT: the up projection's sums
    if PDL:  # the first K block, with the weight tile fetched before the wait
        acc, acc_up, ss = _step(acc, acc_up, ss, w_first, w_up_first, x_rows, r_rows, nw_ptr,
                                sum_rows, K, ks0, ks0 < k_hi, m_ok, rstd, writes_sum, dtype,
                                NORM, HAS_RES, GATED, ONE_PASS, SILU_OUT, BLOCK_M, UPCAST)
    if ROW_SCALE:
        # The producer's per-tile sums of squares of these rows, loaded now and summed after
        # the loop, so their latency hides behind the weight stream (summed at once, with the
        # latency exposed, the batch-64 step was 1.4 % slower; loaded a chunk per K block
        # inside the loop, it broke the weight pipeline: 1.44-1.47 ms against 1.37).
        ts = tl.arange(0, BLOCK_SS)
        ss_parts = tl.load(ss_ptr + ts[:, None] * M + rm[None, :],
                           mask=(ts < n_ss)[:, None] & m_ok[None, :], other=0.0)
    # tl.range with num_stages: the loads of the M == 1 path feed no dot, and the kernel-wide
    # num_stages only pipelines loads that do.
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        ks = k0 + rk
        k_ok = ks < k_hi
        w_ok = n_ok[:, None] & k_ok[None, :]
        wv = tl.load(w_rows + ks[None, :], mask=w_ok, other=0.0)
        w_up = wv
        if SILU_OUT:
            w_up = tl.load(w_up_rows + ks[None, :], mask=w_ok, other=0.0)
        acc, acc_up, ss = _step(acc, acc_up, ss, wv, w_up, x_rows, r_rows, nw_ptr, sum_rows, K,
                                ks, k_ok, m_ok, rstd, writes_sum, dtype, NORM, HAS_RES, GATED,
                                ONE_PASS, SILU_OUT, BLOCK_M, UPCAST)
    if PF_LINES > 0:  # own weights all requested: warm L2 with the next projection's
        prefetch_l2(pf_ptr, pf_total, tl.program_id(0) + tl.program_id(1) * tl.num_programs(0),
                    PF_LINES, PF_LINE)
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
        if SILU_OUT:
            acc_up = tl.sum(acc_up, axis=1)[None, :]
    if ONE_PASS:
        inv_rms = (1.0 / tl.sqrt_rn(ss / K + eps))[:, None]
        acc = acc * inv_rms
        acc_up = acc_up * inv_rms
    if ROW_SCALE:
        inv_rms = (1.0 / tl.sqrt_rn(tl.sum(ss_parts, axis=0) / K + eps))[:, None]
        acc = acc * inv_rms
        acc_up = acc_up * inv_rms
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU_OUT:  # rounded like the separate kernels: both projections, silu, the product
        g = acc.to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        acc = silu * acc_up.to(dtype).to(tl.float32)
    out_mask = m_ok[:, None] & n_ok[None, :]
    flat = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if tl.num_programs(1) == 1:
        if RES_OUT:  # rounded like the reference: the projection, then the fp32 add
            rv = tl.load(r_ptr + rm.to(tl.int64)[:, None] * sr + rn[None, :], mask=out_mask,
                         other=0.0)
            acc = acc.to(dtype).to(tl.float32) + rv.to(tl.float32)
        if GATHER:
            whole = (rm.to(tl.int64)[:, None] * (N * WORLD)
                     + (RANK * N + rn)[None, :])
            tl.store(out_ptr + whole, acc.to(dtype), mask=out_mask)
            land_tile(acc.to(dtype), flat, out_mask, land_ptrs, count_ptrs, land_box_elems,
                      RANK, WORLD, _INTERPRET_C)
        else:
            tl.store(out_ptr + flat, acc.to(dtype), mask=out_mask)
        if PUSH:
            lo, hi = tl.split(tl.reshape(acc.to(dtype), [BLOCK_M, BLOCK_N // 2, 2]))
            word_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            push_words(pair_words(lo, hi),
                       rm.to(tl.int64)[:, None] * (N // 2) + word_cols[None, :],
                       m_ok[:, None] & (word_cols < N // 2)[None, :], push_ptrs,
                       push_slot_words, push_box_words, RANK, WORLD)
        if NORM_OUT:
            _norm_out(acc.to(dtype), flat, rm, rn, m_ok, n_ok, pid_n, M, nw_ptr, g_ptr, ss_ptr)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + flat, acc, mask=out_mask)


@triton.jit
def _norm_out(h, flat, rm, rn, m_ok, n_ok, tile, M, nw_ptr, g_ptr, ss_ptr):
    """NORM_OUT: for the finished output tile h (rows rm, columns rn, the output dtype), the
    next RMSNorm's share: g = h * norm weight, rounded, and each row's sum of squares over the
    tile's columns into ss[tile, row] (masked elements of h are 0 and add nothing)."""
    hf = h.to(tl.float32)
    nw = tl.load(nw_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(g_ptr + flat, (hf * nw[None, :]).to(h.dtype), mask=m_ok[:, None] & n_ok[None, :])
    tl.store(ss_ptr + tile * M + rm, tl.sum(hf * hf, axis=1), mask=m_ok)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(ws_ptr, out_ptr, res_ptr, nw_ptr, g_ptr, ss_ptr, push_ptrs, M, N,
                      push_slot_words, push_box_words, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr, RES_OUT: tl.constexpr, NORM_OUT: tl.constexpr,
                      PDL: tl.constexpr, PUSH: tl.constexpr, RANK: tl.constexpr,
                      WORLD: tl.constexpr):
    """Program (row, column block): the K splits' fp32 partials summed in split order; RES_OUT:
    plus the (dense) residual, after rounding the sum as the single-split epilogue does;
    NORM_OUT: the next norm's share, as _norm_out; PUSH: as _linear_kernel's."""
    pdl.prologue(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    offs = row.to(tl.int64) * N + cols
    total = M.to(tl.int64) * N
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
    if RES_OUT:
        acc = acc.to(dtype).to(tl.float32) + tl.load(res_ptr + offs, mask=ok).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(dtype), mask=ok)
    if PUSH:
        lo, hi = tl.split(tl.reshape(acc.to(dtype), [BLOCK // 2, 2]))
        word_cols = tl.program_id(1) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        push_words(pair_words(lo, hi), row.to(tl.int64) * (N // 2) + word_cols,
                   word_cols < N // 2, push_ptrs, push_slot_words, push_box_words, RANK,
                   WORLD)
    if NORM_OUT:
        rows = row + tl.arange(0, 1)
        _norm_out(acc.to(dtype)[None, :], offs[None, :], rows, cols, rows < M, ok,
                  tl.program_id(1), M, nw_ptr, g_ptr, ss_ptr)


def pick_config(m: int, n: int, k: int, t: LinearTuning = _TUNING) -> LinearConfig:
    """Per-shape launch parameters from the table t (tools/lab/tune_linear.py measured them).

    M = 1: many small CUDA-core programs, no split; under programmatic dependent launch a
    program fetches its first weight tile before waiting for the previous kernel; a long K
    takes fewer columns and longer steps. M > 1: tensor-core tiles with 4 pipeline stages; wide
    N tiles only for the wide weights (gate_up, lm_head). K is split only when it is longer
    than N (the down projection), where few output tiles each walk a long reduction;
    elsewhere the partial-sum kernel cost more than the programs it added."""
    if m == 1:
        return t.one_row_long if k >= t.one_row_long_k else t.one_row
    block_m = 16 if m <= 16 else 64
    wide = n >= t.wide_n
    block_n = 64 if wide else (32 if n >= 3072 or block_m == 64 else 16)
    block_k = 256 if block_m == 16 and not wide else 128
    stages = 3 if wide and block_m == 64 else 4
    split = 1
    if k > n:
        programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        split = _split_k(programs, t.split_programs, k, block_k)
    return LinearConfig(block_m, block_n, block_k, split, num_stages=stages)


def pick_norm_config(m: int, n: int, k: int, t: LinearTuning = _TUNING) -> LinearConfig:
    """With the norm in the prologue each program first reads its rows once for the mean square,
    so fewer, wider programs won at one row."""
    if m == 1:
        return t.one_row_norm
    return pick_config(m, n, k, t)


def _split_k(programs: int, want_programs: int, k: int, block_k: int) -> int:
    """Doubles the K split until there are enough programs, keeping >= 2 K blocks per split."""
    split = 1
    while programs * split < want_programs and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def supported(x: torch.Tensor, weight: torch.Tensor, width: int = 1,
              *others: torch.Tensor | None, max_rows: int | None = _TUNING.max_rows) -> bool:
    """Whether the kernel takes these operands. width: x's columns per weight column (2 for
    [gate | up]); max_rows: the most rows it takes (None: any); others: bias, residual, norm
    weight (None where absent) must match x's dtype and device and be dense, else the caller
    falls back to torch."""
    if not (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == width * weight.shape[1]
            and 0 < x.shape[0] and (max_rows is None or x.shape[0] <= max_rows)
            and x.dtype in (torch.bfloat16, torch.float16)
            and (x.is_cuda or _INTERPRET) and x.stride(-1) == 1):
        return False
    return all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
               for t in (weight, *others) if t is not None)


def _launch(x, residual, norm_weight, eps, weight, bias, config: LinearConfig | None,
            gated: bool = False, silu_out: bool = False, res_out: torch.Tensor | None = None,
            norm_out: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
            prefetch: torch.Tensor | None = None, prefetch_bytes: int = 0,
            push: Push | None = None, gather: Landing | None = None,
            t: LinearTuning = _TUNING):
    """gated: x is [gate | up] and the input silu(gate) * up; silu_out: the weight is
    [gate | up] and the output silu(gate) * up; res_out: a residual added to the output;
    norm_out: with res_out, the next norm's weight, and then (out, summed, g, ss) come back
    (linear_fused_triton.Prenormed); row_scale: a Prenormed's ss, x being its g (eps: the
    norm's); prefetch: the weight of the projection after this one, whose first
    prefetch_bytes the programs ask L2 for after their own loop (kernels/l2_prefetch.py);
    push: the output also goes to the peers as this rank's message of an all-reduce (a plain
    projection only: no residual, norm or silu epilogue); gather: the output is the whole
    logits over the ranks' vocabulary slices, this rank's computed here and the peers' landed
    (kernels/gather_triton.py; a plain projection without split K)."""
    m = x.shape[0]
    n, k = weight.shape
    if silu_out:
        n //= 2
    cfg = config or (pick_norm_config if norm_weight is not None else pick_config)(m, n, k, t)
    out = _new((m, n * gather.world if gather is not None else n), x.dtype, x.device)
    summed = _new((m, k), x.dtype, x.device) if residual is not None else x
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    if split > 1 and silu_out:
        raise ValueError(f"the silu epilogue needs whole K sums, got split_k={cfg.split_k}")
    if silu_out and bias is not None or res_out is not None and residual is not None:
        raise ValueError("the silu epilogue takes no bias, and a residual goes either into "
                         "the prologue or the epilogue")
    if norm_out is not None and (res_out is None or silu_out) or (
            row_scale is not None and norm_weight is not None):
        raise ValueError("the norm's share goes after a residual epilogue, and its 1 / rms "
                         "onto a projection without a norm of its own")
    if push is not None and (silu_out or res_out is not None or norm_out is not None
                             or not push.fits(m, n, out.dtype)):
        raise ValueError(f"push: only a plain projection's 16-bit output of even width "
                         f"within a box goes to the peers, got {tuple(out.shape)} {out.dtype}")
    if gather is not None and (split > 1 or silu_out or res_out is not None or push is not None
                               or norm_out is not None or not gather.fits(m, n, x.dtype)):
        raise ValueError(f"gather: only a plain projection without split K, its [{m}, {n}] "
                         f"{x.dtype} output within a landing box")
    ws = _new((split, m, n), torch.float32, x.device) if split > 1 else out
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), split)
    dependent = pdl.enabled(x)
    r = residual if residual is not None else (res_out if res_out is not None else x)
    g = ss = None
    if norm_out is not None:
        g = _new((m, n), x.dtype, x.device)
        tiles = triton.cdiv(n, cfg.block_n if split == 1 else t.split_sum_block)
        ss = _new((tiles, m), torch.float32, x.device)
    nw = next(t for t in (norm_weight, norm_out, x) if t is not None)
    n_ss = 0 if row_scale is None else row_scale.shape[0]
    # the peers' areas, where this rank's box of the slot starts, a box's words; rank, world
    push_ptrs = (push.areas.area_ptrs if push is not None else x,)
    push_words_at = (push.slot_words, push.areas.max_words) if push is not None else (0, 0)
    peers = push.areas if push is not None else gather  # this rank among the ranks, or None
    ranks = (dict(RANK=peers.rank, WORLD=peers.world) if peers is not None
             else dict(RANK=0, WORLD=1))
    land_ptrs = ((gather.landing_ptrs, gather.counter_ptrs) if gather is not None
                 else (x, x))
    pf_lines = 0 if _INTERPRET else lines_per_program(prefetch, prefetch_bytes,
                                                      grid[0] * grid[1])
    _linear_kernel[grid](
        x, r, nw, weight, bias if bias is not None else x, out, summed, ws,
        g if g is not None else out, next(t for t in (ss, row_scale, out) if t is not None),
        prefetch if pf_lines else x, *push_ptrs, *land_ptrs, m, n, k, k_per_split, eps,
        x.stride(0), r.stride(0), n_ss, prefetch.numel() if pf_lines else 0, *push_words_at,
        gather.box_bytes // x.element_size() if gather is not None else 0,
        NORM=norm_weight is not None, HAS_RES=residual is not None, GATED=gated,
        HAS_BIAS=bias is not None,
        ONE_PASS=norm_weight is not None and split == 1,
        SILU_OUT=silu_out, RES_OUT=res_out is not None,
        NORM_OUT=norm_out is not None and split == 1, ROW_SCALE=row_scale is not None,
        BLOCK_SS=triton.next_power_of_2(max(n_ss, 1)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages, UPCAST=_INTERPRET and x.dtype == torch.bfloat16, PDL=dependent,
        PF_LINES=pf_lines, PF_LINE=LINE_BYTES // (prefetch.element_size() if pf_lines else 1),
        PUSH=push is not None and split == 1, **ranks, GATHER=gather is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=dependent)
    if split > 1:
        block = min(t.split_sum_block, triton.next_power_of_2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            ws, out, r, nw, g if g is not None else out, ss if ss is not None else out,
            *push_ptrs, m, n, *push_words_at, SPLIT=split, BLOCK=block,
            RES_OUT=res_out is not None, NORM_OUT=norm_out is not None, PDL=dependent,
            PUSH=push is not None, **ranks, num_warps=4, launch_pdl=dependent)
    if gather is not None:
        wait_and_place(gather, out, grid[0] * grid[1])
    if norm_out is not None:
        return out, summed, g, ss
    return out, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: LinearConfig | None = None, max_rows: int | None = None,
           prefetch: torch.Tensor | None = None, prefetch_bytes: int = 0,
           t: LinearTuning = _TUNING) -> torch.Tensor:
    """max_rows: above it cuBLAS (default t.max_rows; the "auto" projections pass theirs);
    prefetch: see _launch; t: the table (here and below)."""
    if not supported(x, weight, 1, bias, max_rows=max_rows or t.max_rows):
        return F.linear(x, weight, bias)
    return _launch(x, None, None, 0.0, weight, bias, config, prefetch=prefetch,
                   prefetch_bytes=prefetch_bytes, t=t)[0]


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                    max_rows: int | None = None, prefetch: torch.Tensor | None = None,
                    prefetch_bytes: int = 0, t: LinearTuning = _TUNING) -> torch.Tensor:
    """linear(silu(gate) * up): up to t.fuse_max_rows rows (or any given config) the
    activation runs in the down projection's prologue, saving a launch and the intermediate's
    round trip through memory; above, the activation kernel then linear()."""
    if not supported(gate_up, weight, 2, bias, max_rows=max_rows or t.max_rows):
        return silu_mul_then_linear(gate_up, weight, bias)
    if config is None and gate_up.shape[0] > t.fuse_max_rows:
        return linear(silu_mul(gate_up), weight, bias, max_rows=max_rows, prefetch=prefetch,
                      prefetch_bytes=prefetch_bytes, t=t)
    return _launch(gate_up, None, None, 0.0, weight, bias, config, gated=True,
                   prefetch=prefetch, prefetch_bytes=prefetch_bytes, t=t)[0]


def silu_mul_then_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Two kernels: the Triton activation, then cuBLAS."""
    return F.linear(silu_mul(gate_up), weight, bias)


def norm_then_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two kernels: the Triton (add +) RMSNorm, then cuBLAS."""
    normed, summed = _norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def _norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) with the Triton norm kernel; x itself as the sum
    when there is no residual."""
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return add_rms_norm(x, residual, norm_weight, eps)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: LinearConfig | None = None, max_rows: int | None = None,
                prefetch: torch.Tensor | None = None, prefetch_bytes: int = 0,
                t: LinearTuning = _TUNING) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel up to t.fuse_max_rows rows (or any given config). Beyond that every program
    re-reading the rows for their mean square costs more than the separate norm launch it
    saves: the norm kernel, then linear()."""
    if (not supported(x, weight, 1, bias, residual, norm_weight, max_rows=max_rows or t.max_rows)
            or (residual is not None and residual.shape != x.shape)):
        return norm_then_linear(x, residual, norm_weight, eps, weight, bias)
    if config is None and x.shape[0] > t.fuse_max_rows:
        normed, summed = _norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias, max_rows=max_rows, prefetch=prefetch,
                      prefetch_bytes=prefetch_bytes, t=t), summed
    return _launch(x, residual, norm_weight, eps, weight, bias, config, prefetch=prefetch,
                   prefetch_bytes=prefetch_bytes, t=t)
