"""The building blocks the quantized projection kernels share (kernels/linear_quant_triton.py,
kernels/linear_w4a16_triton.py, kernels/linear_w8a8_triton.py): a program's tile and the
epilogue that makes a program's fp32 sums into the output tile in the kernel that computed
them. References: kernels/linear.py, kernels/rmsnorm.py.

Under split K the programs of one output tile each store their partial, then take a ticket
(kernels/tickets.py); the program that draws the last one sums the partials in split order
(deterministic, the same sums a separate split-sum kernel would make) and finishes the tile.
A decode step at one row launched a split-sum kernel after every int4 projection; each cost
more in launch and drain than its sums.

The finished tile may add the residual stream (RES_OUT, rounded as the reference: the
projection to the dtype, then the fp32 add) and begin the next RMSNorm (NORM_OUT:
kernels.Prenormed); a projection reading a Prenormed takes its 1 / rms from the producer's
per-tile sums of squares (linear_tiles_triton.row_rstd) and scales its sums with it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import linear_tiles_triton as tiles


@triton.jit
def tile_ids(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's rows, columns, K range and column block. Row blocks vary fastest: the row
    blocks of one column block run together and share its weight tile through L2 (many rows
    would otherwise stream the weight once per row block)."""
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_n = pid // m_blocks
    rm = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * k_per_split
    return rm, rn, rm < M, rn < N, k_lo, tl.minimum(k_lo + k_per_split, K), pid_n


@triton.jit
def _epilogue(acc, out_ptr, b_ptr, r_ptr, nw_ptr, g_ptr, ss_ptr, rm, rn, m_ok, n_ok, tile, M,
              N, sr, HAS_BIAS: tl.constexpr, RES_OUT: tl.constexpr, NORM_OUT: tl.constexpr):
    """The whole sums acc [BLOCK_M, BLOCK_N] (+ bias; + the residual r, RES_OUT) stored as the
    output tile; NORM_OUT: the next norm's share too, ss being [column tiles, M]."""
    dtype = out_ptr.dtype.element_ty
    flat = rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if RES_OUT:
        rv = tl.load(r_ptr + rm.to(tl.int64)[:, None] * sr + rn[None, :], mask=mask, other=0.0)
        acc = acc.to(dtype).to(tl.float32) + rv.to(tl.float32)
    h = acc.to(dtype)
    tl.store(out_ptr + flat, h, mask=mask)
    if NORM_OUT:
        tiles.norm_out(h, flat, rm, rn, m_ok, n_ok, tile, M, nw_ptr, g_ptr, ss_ptr)


@triton.jit
def finish_tile(acc, out_ptr, ws_ptr, cnt_ptr, b_ptr, r_ptr, nw_ptr, g_ptr, ss_ptr, rm, rn,
                m_ok, n_ok, tile, M, N, sr, HAS_BIAS: tl.constexpr, RES_OUT: tl.constexpr,
                NORM_OUT: tl.constexpr, SPLIT: tl.constexpr):
    """This program's fp32 sums acc [BLOCK_M, BLOCK_N] over its K split, for output tile
    program_id(0) (`tile`: its column block). One split: the epilogue now. Under SPLIT splits
    (the grid's second axis): the partial into ws [SPLIT, M, N], and the program with the last
    ticket of cnt_ptr[tile id] sums the partials in split order (all loads issued at once,
    past L1: other SMs wrote them), runs the epilogue and resets the counter."""
    if SPLIT == 1:
        _epilogue(acc, out_ptr, b_ptr, r_ptr, nw_ptr, g_ptr, ss_ptr, rm, rn, m_ok, n_ok, tile,
                  M, N, sr, HAS_BIAS, RES_OUT, NORM_OUT)
    else:
        flat = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        part = M.to(tl.int64) * N
        tl.store(ws_ptr + tl.program_id(1) * part + flat, acc, mask=mask)
        # every warp's stores are issued before the ticket's release makes them visible
        tl.debug_barrier()
        counter = cnt_ptr + tl.program_id(0)
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + s * part + flat, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _epilogue(total, out_ptr, b_ptr, r_ptr, nw_ptr, g_ptr, ss_ptr, rm, rn, m_ok, n_ok,
                      tile, M, N, sr, HAS_BIAS, RES_OUT, NORM_OUT)
            tl.store(counter, 0)
