"""The quantized projections, W8A16 and W4A16: the weight read as stored (kernels/quant.py),
dequantized in registers, and the scale applied to the sums rather than to each weight.
Reference: kernels/linear_quant.py (same signature).

Why this shape: a decode step streams every weight once, so the bytes read set its floor, and a
quantized weight is read at 1 (fp8) or a bit over 0.5 (int4) bytes an element instead of 2.
fp8 converts to the activation dtype exactly and its per-channel scale is constant along K,
so it multiplies the finished sum in the epilogue. An int4 group's scale is constant over a
group of K, so a K tile never spans two groups (block_k is cut to the group size) and the
tile's partial sum is scaled once per output column before it joins the accumulator. A tile's
packed words come in one vector load and are spread to their eight values in the thread that
loaded them (_nibbles); the codes (q - zero) are small integers, exact in bf16/fp16, so a
tensor-core dot takes them as they are.

Each program owns BLOCK_M rows x BLOCK_N columns. fp8 one-row batches use CUDA-core dot
products (block_m 1), more rows tensor-core tiles; int4 always takes tensor-core tiles. When
the columns give too few programs, K is split and linear_triton's partial-sum kernel adds the
fp32 partials in split order (deterministic).

fp8 weights from QuantLinearTuning.fp8_scaled_mm_min_rows rows take W8A8 instead
(takes_w8a8): the norm or activation kernel quantizes the rows, kernels/linear_w8a8_triton.py
(or torch._scaled_mm past 64 rows) multiplies.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import linear_fp8_rows, quant_rows_triton
from . import linear_tiles_triton as tiles
from . import pdl
from .linear_w8a8_triton import matmul_rows
from .quant_rows_triton import quantize_rows
from .linear_triton import _split_k, sum_splits
from .dequant_triton import dequantize
from .linear_quant import linear_quant_ref
from .quant import QuantizedWeight
from .tuning import DEFAULT, LinearConfig, QuantLinearTuning  # noqa: F401 (tests)

# Triton's CPU interpreter gets bf16 tl.dot wrong; there the operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TUNING = DEFAULT.quant_linear


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests replace it to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


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
def _w4_tile(w_rows, s_rows, z_rows, ssg, szg, k0, k_hi, n_ok, GROUP: tl.constexpr,
             HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(the codes q - zero [BLOCK_N, BLOCK_K] in fp32, the tile's group scale [BLOCK_N]). The
    tile's words [BLOCK_N, BLOCK_K / 8] come in one vector load; k = word * 8 + j takes value
    j of its word (_nibbles)."""
    wk = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), BLOCK_K // 8),
                           BLOCK_K // 8)
    words = tl.load(w_rows + wk[None, :], mask=n_ok[:, None] & (wk < k_hi // 8)[None, :],
                    other=0)
    g = k0 // GROUP
    scale = tl.load(s_rows + g * ssg, mask=n_ok, other=0.0)
    offset = tl.full([BLOCK_N], 8388616.0, tl.float32)  # 2^23 + 8
    if HAS_ZERO:
        offset += tl.load(z_rows + g * szg, mask=n_ok, other=0).to(tl.float32)
    return _nibbles(words, BLOCK_N, BLOCK_K) - offset[:, None], scale


@triton.jit
def _nibble(words, j: tl.constexpr):
    """Value j of every word, ORed into the mantissa of 2^23 (a float whose ulp is 1): the
    float 2^23 + value, exactly, with no int-to-float conversion."""
    return (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _nibbles(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] floats 2^23 + value, k = word * 8 + j. tl.join keeps the eight
    values of a word in the thread that loaded it, so the reshape moves no data (one that
    broadcast the words against eight shifts went through shared memory every tile). Joins
    append the new axis last, so the pairs nest as j = 4 * j2 + 2 * j1 + j0."""
    n = (_nibble(words, 0), _nibble(words, 1), _nibble(words, 2), _nibble(words, 3),
         _nibble(words, 4), _nibble(words, 5), _nibble(words, 6), _nibble(words, 7))
    even = tl.join(tl.join(n[0], n[4]), tl.join(n[2], n[6]))
    odd = tl.join(tl.join(n[1], n[5]), tl.join(n[3], n[7]))
    return tl.reshape(tl.join(even, odd), [BLOCK_N, BLOCK_K])


@triton.jit
def _accumulate(acc, x, w, scale, DOT: tl.constexpr, UPCAST: tl.constexpr,
                SCALED: tl.constexpr):
    """acc plus x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed, times scale per
    output column when SCALED (int4, whose tiles are all tensor-core ones). Tensor-core tiles
    (DOT) add finished [BLOCK_M, BLOCK_N] sums; one row (BLOCK_M 1) adds the
    [BLOCK_N, BLOCK_K] products, reduced once after the loop."""
    if DOT:
        if UPCAST:
            p = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            p = tl.dot(x, tl.trans(w.to(x.dtype)))
        if SCALED:
            p = p * scale[None, :]
    else:
        p = w.to(tl.float32) * x.to(tl.float32)
    return acc + p


@triton.jit
def _step(acc, w, scale, x_rows, r_rows, nw_ptr, K, k0, k_hi, m_ok, rstd, dtype: tl.constexpr,
          NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, DOT: tl.constexpr,
          UPCAST: tl.constexpr, SCALED: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K block: the input tile through the prologue, times the weight tile w."""
    x = _x_tile(x_rows, r_rows, nw_ptr, K, k0, k_hi, m_ok, rstd, dtype, NORM, HAS_RES, GATED,
                BLOCK_K)
    return _accumulate(acc, x, w, scale, DOT, UPCAST, SCALED)


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
        acc = _accumulate(acc, x, w, w, DOT, UPCAST, False)
        ss += part
    else:
        acc = _step(acc, w, w, x_rows, r_rows, nw_ptr, K, k0, k_hi, m_ok, rstd, dtype, NORM,
                    HAS_RES, GATED, DOT, UPCAST, False, BLOCK_K)
    return acc, ss


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _writes_sum(M, BLOCK_M: tl.constexpr):
    """Whether this program stores the residual sum of its rows: the first column block's, of
    the first K split."""
    return (tl.program_id(0) // tl.cdiv(M, BLOCK_M) == 0) & (tl.program_id(1) == 0)


@triton.jit
def _tile_ids(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's rows, columns and K range. Row blocks vary fastest: the row blocks of one
    column block run together and share its weight tile through L2 (many rows would otherwise
    stream the weight once per row block)."""
    m_blocks = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    rm = (pid % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // m_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * k_per_split
    return rm, rn, rm < M, rn < N, k_lo, tl.minimum(k_lo + k_per_split, K)


# M is the batch: never specialise on it, or every new batch size would compile again. Under
# programmatic dependent launch (PDL, kernels/pdl.py) a program lets the next kernel launch,
# fetches its first weight tile (weights are never written during decode), and only then waits
# for the kernel before it, whose output x is.
@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, M, N, K,
                  k_per_split, sx, sr, eps, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                  GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                  UPCAST: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                  ONE_PASS: tl.constexpr):
    """fp8 e4m3 weight [N, K], fp32 scale [N]: out = (x @ q.T) * scale, x through the
    prologue (_x_tile, or _w8_step's one-pass norm)."""
    rm, rn, m_ok, n_ok, k_lo, k_hi = _tile_ids(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
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
    writes_sum = _writes_sum(M, BLOCK_M)
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
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        w = _w8_tile(w_rows, k0, k_hi, n_ok, BLOCK_K)
        acc, ss = _w8_step(acc, ss, w, *prologue, k0, k_hi, m_ok, rstd, writes_sum, dtype,
                           NORM, HAS_RES, GATED, DOT, UPCAST, ONE_PASS, BLOCK_K)
    if BLOCK_M == 1:  # the row's products, reduced once
        acc = tl.sum(acc, axis=1)[None, :]
    if ONE_PASS:
        acc = acc * (1.0 / tl.sqrt_rn(ss / K + eps))[:, None]
    scale = tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    tiles.store_tile(acc * scale[None, :], out_ptr, ws_ptr, b_ptr, rm, rn, m_ok, n_ok, M, N,
                     HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, r_ptr, nw_ptr, sum_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr,
                  M, N, K, KW, k_per_split, sx, sr, ssn, ssg, szn, szg, eps,
                  NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
                  GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT: tl.constexpr, UPCAST: tl.constexpr, STAGES: tl.constexpr,
                  PDL: tl.constexpr):
    """int4 weight [N, K / 8] int32 (value j of a word at bits 4j, stored as q + 8), fp32 scale
    and int8 zero point [N, K / GROUP] (strides ssn, ssg and szn, szg): out = sum over groups
    of (x @ (q - zero).T) * scale, on tensor-core tiles only (BLOCK_M >= 16, a single row
    padded to 16): per weight, the unpacking costs more than a CUDA-core dot can hide (one row
    on CUDA cores reached 0.10-0.17 of the bytes floor on an H100, a 16-row tile 0.25-0.35).
    BLOCK_K divides GROUP, so a tile's columns share one scale per output column. KW = K / 8,
    the words a row, passed so that Triton sees its alignment (vector loads). x goes through
    the prologue (_x_tile)."""
    rm, rn, m_ok, n_ok, k_lo, k_hi = _tile_ids(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    r_rows = r_ptr + rm.to(tl.int64)[:, None] * sr
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * KW
    s_rows = s_ptr + rn.to(tl.int64) * ssn
    z_rows = z_ptr + rn.to(tl.int64) * szn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = k_lo
    if PDL:
        pdl.gdc_launch_dependents()
        codes0, scale0 = _w4_tile(w_rows, s_rows, z_rows, ssg, szg, k_lo, k_hi, n_ok, GROUP,
                                  HAS_ZERO, BLOCK_N, BLOCK_K)
        pdl.gdc_wait()
    rstd = _rstd(x_rows, r_rows, sum_ptr, rm, K, eps, m_ok, _writes_sum(M, BLOCK_M), dtype,
                 NORM, HAS_RES, BLOCK_M, BLOCK_K)
    prologue = (x_rows, r_rows, nw_ptr, K)
    if PDL:
        acc = _step(acc, codes0, scale0, *prologue, k_lo, k_hi, m_ok, rstd, dtype, NORM,
                    HAS_RES, GATED, DOT, UPCAST, True, BLOCK_K)
        k_start = k_lo + BLOCK_K
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        codes, scale = _w4_tile(w_rows, s_rows, z_rows, ssg, szg, k0, k_hi, n_ok, GROUP,
                                HAS_ZERO, BLOCK_N, BLOCK_K)
        acc = _step(acc, codes, scale, *prologue, k0, k_hi, m_ok, rstd, dtype, NORM, HAS_RES,
                    GATED, DOT, UPCAST, True, BLOCK_K)
    tiles.store_tile(acc, out_ptr, ws_ptr, b_ptr, rm, rn, m_ok, n_ok, M, N, HAS_BIAS)


def pick_config(m: int, n: int, k: int, block_k_max: int, int4: bool = False,
                t: QuantLinearTuning = _TUNING) -> tuple[LinearConfig, int]:
    """(the tile config, the K split) for m rows of an [n, k] weight; block_k at most
    block_k_max (an int4 group)."""
    cfg = t.config_for(m, n, int4)
    block_k = min(cfg.block_k, block_k_max)
    programs = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    split = _split_k(programs, t.split_programs, k, block_k)
    return LinearConfig(cfg.block_m, cfg.block_n, block_k, split, cfg.num_warps,
                        cfg.num_stages), split


def supported(x: torch.Tensor, weight: QuantizedWeight, max_rows: int, width: int = 1,
              *others: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands, else the reference runs (or, above max_rows,
    the dense GEMM). width: x's columns per weight column (2 for [gate | up]); others: the
    residual and norm weight (None where absent), x's dtype and device, dense."""
    if not (x.dim() == 2 and x.shape[1] == width * weight.shape[1]
            and 0 < x.shape[0] <= max_rows and x.dtype in (torch.bfloat16, torch.float16)
            and (x.is_cuda or _INTERPRET) and x.stride(-1) == 1 and x.device == weight.device):
        return False
    return all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
               for t in others if t is not None)


def _launch(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
            config: LinearConfig | None, t: QuantLinearTuning,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            eps: float = 0.0, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, summed): the projection of x through the prologue (the RMSNorm of x + residual
    by norm_weight, or silu(gate) * up when gated), and x + residual (x itself without a
    residual or a norm)."""
    m = x.shape[0]
    n, k = weight.shape
    group = weight.group_size if weight.format == "int4" else k
    if config is None:
        config, split = pick_config(m, n, k, group, weight.format == "int4", t)
    else:
        split = config.split_k
        if weight.format == "int4" and (group % config.block_k or config.block_m == 1):
            raise ValueError(f"int4 takes tensor-core tiles whose block_k divides the "
                             f"group_size={group}; got {config}")
    bk = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    out = _new((m, n), x.dtype, x.device)
    summed = _new((m, k), x.dtype, x.device) if residual is not None else x
    ws = _new((split, m, n), torch.float32, x.device) if split > 1 else out
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m), split)
    dependent = pdl.enabled(x)
    r = residual if residual is not None else x
    prologue = (x, r, norm_weight if norm_weight is not None else x, summed)
    tiles = dict(NORM=norm_weight is not None, HAS_RES=residual is not None, GATED=gated,
                 HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 BLOCK_K=bk, DOT=config.block_m > 1, UPCAST=_INTERPRET,
                 STAGES=config.num_stages, PDL=dependent, num_warps=config.num_warps,
                 num_stages=config.num_stages, launch_pdl=dependent)
    b = bias if bias is not None else out
    if weight.format == "fp8":
        one_pass = t.one_pass_norm and norm_weight is not None and split == 1
        _w8a16_kernel[grid](*prologue, weight.data, weight.scale, b, out, ws, m, n, k,
                            k_per_split, x.stride(0), r.stride(0), eps, ONE_PASS=one_pass,
                            **tiles)
    else:
        z = weight.zero if weight.zero is not None else weight.scale
        _w4a16_kernel[grid](*prologue, weight.data, weight.scale, z, b, out, ws, m, n, k,
                            k // 8, k_per_split, x.stride(0), r.stride(0),
                            *weight.scale.stride(), *z.stride(), eps, GROUP=group,
                            HAS_ZERO=weight.zero is not None, **tiles)
    if split > 1:
        sum_splits(ws, out, bias, t.split_sum_block)
    return out, summed


def linear_quant(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 config: LinearConfig | None = None, t: QuantLinearTuning = _TUNING
                 ) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype. config: a forced tile (tests);
    its split_k is the K split."""
    if config is None and takes_w8a8(x, weight, t):
        q, scale, _ = quantize_rows(x)
        return matmul_rows(q, scale, weight, bias, x.dtype, t)
    if not supported(x, weight, t.max_rows if config is None else x.shape[0]):
        if supported(x, weight, x.shape[0]):  # many rows: the dense GEMM on a one-pass copy
            return F.linear(x, dequantize(weight, x.dtype, t), bias)
        return linear_quant_ref(x, weight, bias)
    return _launch(x, weight, bias, config, t)[0]


def takes_w8a8(x: torch.Tensor, weight: QuantizedWeight, t: QuantLinearTuning = _TUNING,
               gated: bool = False) -> bool:
    """Whether these rows of an fp8 weight run W8A8 on the fp8 tensor cores (activations
    quantized per row: kernels/quant_rows_triton.py, kernels/linear_fp8_rows.py). gated: x is
    [gate | up], twice the weight's K."""
    if not (weight.format == "fp8" and 0 < t.fp8_scaled_mm_min_rows <= x.shape[0]
            and x.is_cuda and x.device == weight.device
            and quant_rows_triton.supported(x, gated)):
        return False
    k = x.shape[1] // 2 if gated else x.shape[1]
    return linear_fp8_rows.supported(x[:, :k], weight)


def _fuses(x: torch.Tensor, weight: QuantizedWeight, config: LinearConfig | None,
           t: QuantLinearTuning) -> bool:
    """The prologue in the kernel up to t.fuse_max_rows rows (or with a forced config): above,
    every program re-reading the rows costs more than the separate kernel it saves. Not for
    int4, whose one row is padded to a 16-row tile: every program would compute the prologue
    for 16 rows (llama-8b's int4 step at one row took 7.94 ms fused, 4.74 ms unfused, on an
    H100)."""
    return config is not None or (x.shape[0] <= t.fuse_max_rows and weight.format == "fp8")


def norm_linear_quant(x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float, weight: QuantizedWeight,
                      bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                      t: QuantLinearTuning = _TUNING) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_quant(rms_norm(x + residual)), x + residual): one kernel at one row, else the
    norm kernel then linear_quant (W8A8: the norm kernel quantizes its rows). Reference:
    linear_quant.norm_linear_quant_ref."""
    if (config is None and takes_w8a8(x, weight, t)
            and (residual is None or residual.shape == x.shape)
            and all(v.dtype == x.dtype and v.is_contiguous()
                    for v in (residual, norm_weight) if v is not None)):
        q, scale, summed = quantize_rows(x, residual, norm_weight, eps)
        return matmul_rows(q, scale, weight, bias, x.dtype, t), summed
    if (not _fuses(x, weight, config, t) or not supported(x, weight, x.shape[0], 1, residual,
                                                  norm_weight)
            or (residual is not None and residual.shape != x.shape)):
        from .linear_triton import _norm

        normed, summed = _norm(x, residual, norm_weight, eps)
        return linear_quant(normed, weight, bias, t=t), summed
    return _launch(x, weight, bias, config, t, residual, norm_weight, eps)


def silu_mul_linear_quant(gate_up: torch.Tensor, weight: QuantizedWeight,
                          bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                          t: QuantLinearTuning = _TUNING) -> torch.Tensor:
    """linear_quant(silu(gate) * up): the activation in the kernel's prologue at one row, else
    the activation kernel then linear_quant (W8A8: silu * up quantized in one kernel).
    Reference: linear_quant.silu_mul_linear_quant_ref."""
    if config is None and takes_w8a8(gate_up, weight, t, gated=True):
        q, scale, _ = quantize_rows(gate_up, gated=True)
        return matmul_rows(q, scale, weight, bias, gate_up.dtype, t)
    if (not _fuses(gate_up, weight, config, t)
            or not supported(gate_up, weight, gate_up.shape[0], 2)):
        from .activation_triton import silu_mul

        return linear_quant(silu_mul(gate_up), weight, bias, t=t)
    return _launch(gate_up, weight, bias, config, t, gated=True)[0]
