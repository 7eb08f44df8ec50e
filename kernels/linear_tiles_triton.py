"""The Triton building blocks of the projection kernels (kernels/linear_triton.py): the input
tile of each prologue (x, silu(gate) * up, the RMSNorm of x + residual in one pass or two), the
K loop that every kernel shares (`project`), and the next norm's share that a residual epilogue
begins (`norm_out`)."""
from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .l2_prefetch import prefetch_l2


@triton.jit
def warm_next(pf_ptr, pf_total, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """The program's share of the L2 hint for the next projection's weight, called once its
    own weight loads are all issued (kernels/l2_prefetch.py); PF_LINES 0: no hint."""
    if PF_LINES > 0:
        prefetch_l2(pf_ptr, pf_total, tl.program_id(0) + tl.program_id(1) * tl.num_programs(0),
                    PF_LINES, PF_LINE)


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
        xv = normed_tile(xv, nw_ptr, ks, k_ok, rstd, dtype)
    return xv


@triton.jit
def normed_tile(xv, nw_ptr, ks, k_ok, rstd, dtype: tl.constexpr):
    """The RMSNorm of the summed tile xv by the norm weight, each row's 1 / rms given, rounded
    as kernels/rmsnorm.py rounds (x / rms to the dtype, then the weight's product)."""
    nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
    y = (xv.to(tl.float32) * rstd[:, None]).to(dtype)
    return (y.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)


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


@triton.jit
def load_row_ss(ss_ptr, n_ss, rm, m_ok, M, BLOCK_SS: tl.constexpr):
    """The producer's per-tile sums of squares of rows rm: [BLOCK_SS, BLOCK_M] of ss [n_ss, M]
    (loaded before the K loop, so their latency hides behind the weight stream)."""
    ts = tl.arange(0, BLOCK_SS)
    return tl.load(ss_ptr + ts[:, None] * M + rm[None, :],
                   mask=(ts < n_ss)[:, None] & m_ok[None, :], other=0.0)


@triton.jit
def row_rstd(ss_parts, K, eps):
    """1 / rms of each row [BLOCK_M] from load_row_ss's parts; K: the row's width."""
    return 1.0 / tl.sqrt_rn(tl.sum(ss_parts, axis=0) / K + eps)


@triton.jit
def project(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, sum_ptr, ss_ptr, pf_ptr, M, N, K, k_per_split,
            eps, sx, sr, n_ss, pf_total, dtype: tl.constexpr, NORM: tl.constexpr,
            HAS_RES: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
            ONE_PASS: tl.constexpr, SILU_OUT: tl.constexpr, ROW_SCALE: tl.constexpr,
            BLOCK_SS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
            PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """The inner product every projection kernel shares: this program's [BLOCK_M, BLOCK_N]
    output tile in fp32 over its K split, with the prologue's input (x, silu(gate) * up, or
    the RMSNorm of x + residual), 1 / rms (ONE_PASS, ROW_SCALE), the bias and the silu
    epilogue applied; returns (acc, rm, rn, m_ok, n_ok, pid_n, pid_k, flat, out_mask) for the
    caller's epilogue (flat: the tile's offsets in a dense [M, N] output). Row blocks vary
    fastest: the row blocks of one column block run together and share its weight tile
    through L2 instead of each streaming it from HBM. SILU_OUT: the weight is [gate | up] (2N
    rows) and the output silu(gate) * up, N wide; each program streams the gate rows of its
    columns and the matching up rows, so the activation is an epilogue (no program recomputes
    another's). ROW_SCALE: the input is a Prenormed's g, its 1 / rms from the producer's
    per-tile sums of squares in ss_ptr."""
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % m_blocks
    pid_n = tl.program_id(0) // m_blocks
    pid_k = tl.program_id(1)
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
        # loaded now and summed after the loop (loaded a chunk per K block inside the loop,
        # they broke the weight pipeline)
        ss_parts = load_row_ss(ss_ptr, n_ss, rm, m_ok, M, BLOCK_SS)
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
    warm_next(pf_ptr, pf_total, PF_LINES, PF_LINE)
    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
        if SILU_OUT:
            acc_up = tl.sum(acc_up, axis=1)[None, :]
    if ONE_PASS:
        inv_rms = (1.0 / tl.sqrt_rn(ss / K + eps))[:, None]
        acc = acc * inv_rms
        acc_up = acc_up * inv_rms
    if ROW_SCALE:
        inv_rms = row_rstd(ss_parts, K, eps)[:, None]
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
    return acc, rm, rn, m_ok, n_ok, pid_n, pid_k, flat, out_mask


@triton.jit
def project_plain(x_ptr, w_ptr, pf_ptr, M, N, K, k_per_split, sx, pf_total,
                  dtype: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                  PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """project() of x as it is: no norm, activation, bias or row scale in front."""
    return project(x_ptr, x_ptr, x_ptr, w_ptr, x_ptr, x_ptr, x_ptr, pf_ptr, M, N, K,
                   k_per_split, 0.0, sx, sx, 0, pf_total, dtype, False, False, False, False,
                   False, False, False, 1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, UPCAST, PDL,
                   PF_LINES, PF_LINE)


@triton.jit
def norm_out(h, flat, rm, rn, m_ok, n_ok, tile, M, nw_ptr, g_ptr, ss_ptr):
    """NORM_OUT: for the finished output tile h (rows rm, columns rn, the output dtype), the
    next RMSNorm's share: g = h * norm weight, rounded, and each row's sum of squares over the
    tile's columns into ss[tile, row] (masked elements of h are 0 and add nothing)."""
    hf = h.to(tl.float32)
    nw = tl.load(nw_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(g_ptr + flat, (hf * nw[None, :]).to(h.dtype), mask=m_ok[:, None] & n_ok[None, :])
    tl.store(ss_ptr + tile * M + rm, tl.sum(hf * hf, axis=1), mask=m_ok)


@triton.jit
def store_tile(acc, out_ptr, ws_ptr, b_ptr, rm, rn, m_ok, n_ok, M, N, HAS_BIAS: tl.constexpr):
    """The output tile [BLOCK_M, BLOCK_N] (plus the bias), or under split K the fp32
    partial."""
    flat = rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if tl.num_programs(1) == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + flat, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + tl.program_id(1).to(tl.int64) * M * N + flat, acc, mask=mask)
