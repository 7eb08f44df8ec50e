"""Triton projections for the small row counts of decode (M <= 64), optionally with the RMSNorm
(and the residual add before it) or the MLP's silu * mul folded into the prologue; and a
batch-invariant variant for any row count. Reference: kernels/linear.py.

Why: at decode the projections are weight streaming, and cuBLAS runs the small ones well below
copy bandwidth at M = 1 (about 54% for llama-1b's qkv and o, see docs/benchmarks.md). Each
program owns BLOCK_N output columns, walks K in BLOCK_K steps and reads every weight byte once;
when N / BLOCK_N programs are too few to keep HBM busy, K is split over a second grid axis and a
small kernel sums the fp32 partials in a fixed order (deterministic, no atomics). Three kernels
share the K loop (kernels/linear_tiles_triton.py) and differ in their epilogue: the plain store,
the residual add (which may begin the next norm), and a tensor-parallel rank's send to its peers
(the all-reduce's push, or the LM head's gather).

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

from . import linear_tiles_triton as tiles
from . import pdl
from .all_reduce_triton import Push, pair_words, push_words
from .gather_triton import Landing, land_tile, wait_and_place
from .l2_prefetch import hint as l2_hint
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


# M is the batch: never specialise on it, or every new batch size would compile again. The three
# kernels differ in their epilogue only; the K loop is tiles.project.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, ws_ptr, ss_ptr, pf_ptr,
                   M, N, K, k_per_split, eps, sx, sr, n_ss, pf_total, NORM: tl.constexpr,
                   HAS_RES: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ONE_PASS: tl.constexpr, SILU_OUT: tl.constexpr, ROW_SCALE: tl.constexpr,
                   BLOCK_SS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                   PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """The plain epilogue: the output tile stored (under split K, the fp32 partial in ws)."""
    dtype = out_ptr.dtype.element_ty
    acc, rm, rn, m_ok, n_ok, pid_n, pid_k, flat, out_mask = tiles.project(
        x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, sum_ptr, ss_ptr, pf_ptr, M, N, K, k_per_split, eps,
        sx, sr, n_ss, pf_total, dtype, NORM, HAS_RES, GATED, HAS_BIAS, ONE_PASS, SILU_OUT,
        ROW_SCALE, BLOCK_SS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, UPCAST, PDL, PF_LINES, PF_LINE)
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + flat, acc.to(dtype), mask=out_mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + flat, acc, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _linear_add_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, ws_ptr, g_ptr, ss_ptr, pf_ptr, M,
                       N, K, k_per_split, sx, sr, pf_total, NORM_OUT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
                       PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """The residual epilogue: the output tile plus the residual stream r (M x N), rounded like
    the reference (the projection, then the fp32 add); NORM_OUT: the next RMSNorm begun too
    (tiles.norm_out, by the weight nw; linear_fused_triton.Prenormed). Under split K, the fp32
    partial in ws (_split_sum_kernel adds)."""
    dtype = out_ptr.dtype.element_ty
    acc, rm, rn, m_ok, n_ok, pid_n, pid_k, flat, out_mask = tiles.project_plain(
        x_ptr, w_ptr, pf_ptr, M, N, K, k_per_split, sx, pf_total, dtype, BLOCK_M, BLOCK_N,
        BLOCK_K, STAGES, UPCAST, PDL, PF_LINES, PF_LINE)
    if tl.num_programs(1) == 1:
        rv = tl.load(r_ptr + rm.to(tl.int64)[:, None] * sr + rn[None, :], mask=out_mask,
                     other=0.0)
        acc = acc.to(dtype).to(tl.float32) + rv.to(tl.float32)
        tl.store(out_ptr + flat, acc.to(dtype), mask=out_mask)
        if NORM_OUT:
            tiles.norm_out(acc.to(dtype), flat, rm, rn, m_ok, n_ok, pid_n, M, nw_ptr, g_ptr,
                           ss_ptr)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + flat, acc, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _linear_send_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, pf_ptr, push_ptrs, land_ptrs, count_ptrs,
                        M, N, K, k_per_split, sx, pf_total, push_slot_words, push_box_words,
                        land_box_elems, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr,
                        PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
                        RANK: tl.constexpr, WORLD: tl.constexpr, GATHER: tl.constexpr):
    """A tensor-parallel rank's epilogue (RANK of WORLD): the output tile stored and pushed to
    the peers as this rank's words of an all-reduce (kernels/all_reduce_triton.Push); GATHER:
    the output is the whole [M, WORLD * N] of which this rank computes its N columns, the
    tile also landing in the peers' zones (kernels/gather_triton.py)."""
    dtype = out_ptr.dtype.element_ty
    acc, rm, rn, m_ok, n_ok, pid_n, pid_k, flat, out_mask = tiles.project_plain(
        x_ptr, w_ptr, pf_ptr, M, N, K, k_per_split, sx, pf_total, dtype, BLOCK_M, BLOCK_N,
        BLOCK_K, STAGES, UPCAST, PDL, PF_LINES, PF_LINE)
    if tl.num_programs(1) == 1:
        if GATHER:
            whole = (rm.to(tl.int64)[:, None] * (N * WORLD)
                     + (RANK * N + rn)[None, :])
            tl.store(out_ptr + whole, acc.to(dtype), mask=out_mask)
            land_tile(acc.to(dtype), flat, out_mask, land_ptrs, count_ptrs, land_box_elems,
                      RANK, WORLD, _INTERPRET_C)
        else:
            tl.store(out_ptr + flat, acc.to(dtype), mask=out_mask)
            lo, hi = tl.split(tl.reshape(acc.to(dtype), [BLOCK_M, BLOCK_N // 2, 2]))
            word_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            push_words(pair_words(lo, hi),
                       rm.to(tl.int64)[:, None] * (N // 2) + word_cols[None, :],
                       m_ok[:, None] & (word_cols < N // 2)[None, :], push_ptrs,
                       push_slot_words, push_box_words, RANK, WORLD)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + flat, acc, mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(ws_ptr, out_ptr, res_ptr, nw_ptr, g_ptr, ss_ptr, push_ptrs, M, N,
                      push_slot_words, push_box_words, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr, RES_OUT: tl.constexpr, NORM_OUT: tl.constexpr,
                      PDL: tl.constexpr, PUSH: tl.constexpr, RANK: tl.constexpr,
                      WORLD: tl.constexpr):
    """Program (row, column block): the K splits' fp32 partials summed in split order; RES_OUT:
    plus the (dense) residual, after rounding the sum as the single-split epilogue does;
    NORM_OUT: the next norm's share, as tiles.norm_out; PUSH: as _linear_send_kernel's."""
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
        tiles.norm_out(acc.to(dtype)[None, :], offs[None, :], rows, cols, rows < M, ok,
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


def row_limit(max_rows: int | None, t: LinearTuning) -> int:
    """The most rows a wrapper sends to the kernel: max_rows, or else the table's."""
    return t.max_rows if max_rows is None else max_rows


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
    if res_out is not None and (silu_out or gated or bias is not None or norm_weight is not None
                                or row_scale is not None):
        raise ValueError("the residual epilogue follows a plain projection (no bias, norm or "
                         "activation)")
    if push is not None and (silu_out or res_out is not None or norm_out is not None or gated
                             or norm_weight is not None or row_scale is not None
                             or bias is not None or not push.fits(m, n, out.dtype)):
        raise ValueError(f"push: only a plain projection's 16-bit output of even width "
                         f"within a box goes to the peers, got {tuple(out.shape)} {out.dtype}")
    if gather is not None and (split > 1 or silu_out or res_out is not None or push is not None
                               or norm_out is not None or gated or norm_weight is not None
                               or row_scale is not None or bias is not None
                               or not gather.fits(m, n, x.dtype)):
        raise ValueError(f"gather: only a plain projection without split K, its [{m}, {n}] "
                         f"{x.dtype} output within a landing box")
    ws = _new((split, m, n), torch.float32, x.device) if split > 1 else out
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), split)
    dependent = pdl.enabled(x)
    r = residual if residual is not None else (res_out if res_out is not None else x)
    g = ss = None
    if norm_out is not None:
        g = _new((m, n), x.dtype, x.device)
        n_tiles = triton.cdiv(n, cfg.block_n if split == 1 else t.split_sum_block)
        ss = _new((n_tiles, m), torch.float32, x.device)
    nw = next(v for v in (norm_weight, norm_out, x) if v is not None)
    n_ss = 0 if row_scale is None else row_scale.shape[0]
    # the peers' areas, where this rank's box of the slot starts, a box's words; rank, world
    push_ptrs = (push.areas.area_ptrs if push is not None else x,)
    push_words_at = (push.slot_words, push.areas.max_words) if push is not None else (0, 0)
    peers = push.areas if push is not None else gather  # this rank among the ranks, or None
    ranks = (dict(RANK=peers.rank, WORLD=peers.world) if peers is not None
             else dict(RANK=0, WORLD=1))
    *pf, pf_meta = l2_hint(prefetch, prefetch_bytes, grid[0] * grid[1], x, _INTERPRET)
    loop = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                STAGES=cfg.num_stages, UPCAST=_INTERPRET and x.dtype == torch.bfloat16,
                PDL=dependent, **pf_meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                launch_pdl=dependent)
    if gather is not None or (push is not None and split == 1):
        _linear_send_kernel[grid](
            x, weight, out, ws, pf[0], *push_ptrs,
            *((gather.landing_ptrs, gather.counter_ptrs) if gather is not None else (x, x)),
            m, n, k, k_per_split, x.stride(0), pf[1], *push_words_at,
            gather.box_bytes // x.element_size() if gather is not None else 0, **loop,
            **ranks, GATHER=gather is not None)
    elif res_out is not None:
        _linear_add_kernel[grid](
            x, r, nw, weight, out, ws, g if g is not None else out,
            ss if ss is not None else out, pf[0], m, n, k, k_per_split, x.stride(0),
            r.stride(0), pf[1], NORM_OUT=norm_out is not None and split == 1, **loop)
    else:
        _linear_kernel[grid](
            x, r, nw, weight, bias if bias is not None else x, out, summed, ws,
            row_scale if row_scale is not None else out, pf[0], m, n, k, k_per_split, eps,
            x.stride(0), r.stride(0), n_ss, pf[1], NORM=norm_weight is not None,
            HAS_RES=residual is not None, GATED=gated, HAS_BIAS=bias is not None,
            ONE_PASS=norm_weight is not None and split == 1, SILU_OUT=silu_out,
            ROW_SCALE=row_scale is not None, BLOCK_SS=triton.next_power_of_2(max(n_ss, 1)),
            **loop)
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
    if not supported(x, weight, 1, bias, max_rows=row_limit(max_rows, t)):
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
    if not supported(gate_up, weight, 2, bias, max_rows=row_limit(max_rows, t)):
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
    if (not supported(x, weight, 1, bias, residual, norm_weight, max_rows=row_limit(max_rows, t))
            or (residual is not None and residual.shape != x.shape)):
        return norm_then_linear(x, residual, norm_weight, eps, weight, bias)
    if config is None and x.shape[0] > t.fuse_max_rows:
        normed, summed = _norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias, max_rows=max_rows, prefetch=prefetch,
                      prefetch_bytes=prefetch_bytes, t=t), summed
    return _launch(x, residual, norm_weight, eps, weight, bias, config, prefetch=prefetch,
                   prefetch_bytes=prefetch_bytes, t=t)
