"""The quantized projections, W8A16 and W4A16: the weight read as stored (kernels/quant.py),
dequantized in registers, and the scale applied to the sums rather than to each weight. This
module holds the launch of both (tiles, K splits, the fused prologues and epilogues) and the
routing of fp8 rows to W8A8; the kernels are kernels/linear_w8a16_triton.py and
kernels/linear_w4a16_triton.py. Reference: kernels/linear_quant.py (same signatures).

Why this shape: a decode step streams every weight once, so the bytes read set its floor, and a
quantized weight is read at 1 (fp8) or a bit over 0.5 (int4) bytes an element instead of 2.
fp8 converts to the activation dtype exactly and its per-channel scale is constant along K,
so it multiplies the finished sum in the epilogue. fp8 one-row batches use CUDA-core dot
products (block_m 1), more rows tensor-core tiles. int4 is bound by unpacking, not by its
bytes (kernels/linear_w4a16_triton.py).

When the columns give too few programs, K is split; the last program of each output tile to
finish adds the fp32 partials in split order (deterministic) and runs the epilogue
(kernels/quant_tiles_triton.py): the bias, or the residual add that may begin the next norm.

fp8 weights from QuantLinearTuning.fp8_scaled_mm_min_rows rows take W8A8 instead
(takes_w8a8): the norm or activation kernel quantizes the rows, kernels/linear_w8a8_triton.py
(or torch._scaled_mm past 64 rows) multiplies.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton

from . import linear_fp8_rows, quant_rows_triton
from . import Prenormed, pdl
from .linear_w4a16_triton import _w4a16_kernel
from .linear_w8a16_triton import _w8a16_kernel
from .linear_w8a8_triton import matmul_rows
from .quant_rows_triton import quantize_rows
from .linear_triton import _split_k
from .tickets import ticket_counters
from .dequant_triton import dequantize
from .linear_quant import linear_quant_ref
from .l2_prefetch import hint as l2_hint
from .quant import PLANE_BLOCK, QuantizedWeight, stored
from .tuning import DEFAULT, LinearConfig, QuantLinearTuning  # noqa: F401 (tests)

# Triton's CPU interpreter gets bf16 tl.dot wrong; there the operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_TUNING = DEFAULT.quant_linear


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests replace it to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def pick_config(m: int, n: int, k: int, group: int, int4: bool = False,
                t: QuantLinearTuning = _TUNING) -> tuple[LinearConfig, int]:
    """(the tile config, the K split) for m rows of an [n, k] weight whose scales change every
    `group` columns (k for fp8)."""
    cfg = t.config_for(m, n, int4)
    block_k = _int4_block_k(cfg.block_k, group) if int4 else min(cfg.block_k, group)
    if int4 and m <= t.few_rows_max:
        split = _int4_split(triton.cdiv(n, cfg.block_n) * cfg.block_n, k, block_k, t)
    else:
        programs = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
        want = t.int4_many_rows_programs if int4 else t.split_programs
        split = _split_k(programs, want, k, block_k)
    return LinearConfig(cfg.block_m, cfg.block_n, block_k, split, cfg.num_warps,
                        cfg.num_stages), split


def _int4_split(columns: int, k: int, block_k: int, t: QuantLinearTuning) -> int:
    """The K split of an int4 weight at 1-16 rows (columns: its rows, padded to the tile): the
    largest power of two that leaves each program t.int4_min_split_steps K steps and columns x
    splits within t.int4_split_columns."""
    split = 1
    while ((k // block_k) // (2 * split) >= t.int4_min_split_steps
           and columns * 2 * split <= t.int4_split_columns):
        split *= 2
    return split


def _int4_block_k(block_k: int, group: int) -> int:
    """The deepest int4 tile of at most block_k columns: whole 64-column blocks of the plane
    order inside one group, or one block for groups of 16 or 32."""
    if group < PLANE_BLOCK:
        return PLANE_BLOCK
    bk = max(block_k, PLANE_BLOCK)
    while group % bk:
        bk //= 2
    return bk


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
            eps: float = 0.0, gated: bool = False, res_out: torch.Tensor | None = None,
            norm_out: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
            prefetch=None, prefetch_bytes: int = 0) -> tuple[torch.Tensor, ...]:
    """(out, summed): the projection of x through the prologue (fp8 only: the RMSNorm of
    x + residual by norm_weight, or silu(gate) * up when gated), and x + residual (x itself
    without a residual or a norm). res_out: a residual added to the output; norm_out: with
    res_out, the next norm's weight, and then (out, summed, g, ss) come back
    (linear_fused_triton.Prenormed); row_scale: a Prenormed's ss, x being its g (eps: the
    norm's); prefetch: the next projection's weight (a tensor or a QuantizedWeight), whose
    first prefetch_bytes the programs ask L2 for after their loop (kernels/l2_prefetch.py)."""
    m = x.shape[0]
    n, k = weight.shape
    int4 = weight.format == "int4"
    group = weight.group_size if int4 else k
    normed = residual is not None or norm_weight is not None
    if (normed or gated) and row_scale is not None or normed and res_out is not None:
        raise ValueError("a norm in the prologue takes no row scale or residual epilogue, "
                         "and silu * mul no row scale")
    if norm_out is not None and res_out is None or res_out is not None and bias is not None:
        raise ValueError("the next norm's share follows a residual epilogue, which follows a "
                         "projection without bias")
    if int4 and (normed or gated):
        raise ValueError("the int4 kernel takes no prologue: its one row is a 16-row tile")
    if config is None:
        config, split = pick_config(m, n, k, group, int4, t)
    else:
        split = config.split_k
        if int4 and (config.block_m == 1
                     or _int4_block_k(config.block_k, group) != config.block_k):
            raise ValueError(f"int4 takes tensor-core tiles of whole {PLANE_BLOCK}-column "
                             f"blocks inside one group of group_size={group} (one block for "
                             f"groups of 16 or 32); got {config}")
    bk = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per_split)
    out = _new((m, n), x.dtype, x.device)
    summed = _new((m, k), x.dtype, x.device) if residual is not None else x
    ws = _new((split, m, n), torch.float32, x.device) if split > 1 else out
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, config.block_m), split)
    counters = ticket_counters(x.device, grid[0]) if split > 1 else out
    g = ss = None
    if norm_out is not None:
        g = _new((m, n), x.dtype, x.device)
        ss = _new((triton.cdiv(n, config.block_n), m), torch.float32, x.device)
    n_ss = 0 if row_scale is None else row_scale.shape[0]
    # the epilogue's operands; out stands in for those not used
    res = res_out if res_out is not None else out
    g_out, ss_out = (g, ss) if norm_out is not None else (out, out)
    ss_in = row_scale if row_scale is not None else out
    dependent = pdl.enabled(x) and (config.block_m == 1 or t.pdl_tensor_cores)
    *pf, pf_meta = l2_hint(stored(prefetch), prefetch_bytes, grid[0] * grid[1], x, _INTERPRET)
    meta = dict(**pf_meta, HAS_BIAS=bias is not None, RES_OUT=res_out is not None,
                NORM_OUT=norm_out is not None, ROW_SCALE=row_scale is not None, SPLIT=split,
                BLOCK_SS=triton.next_power_of_2(max(n_ss, 1)), BLOCK_M=config.block_m,
                BLOCK_N=config.block_n, BLOCK_K=bk, STAGES=config.num_stages, PDL=dependent,
                num_warps=config.num_warps, num_stages=config.num_stages,
                launch_pdl=dependent)
    b = bias if bias is not None else out
    nw = next(v for v in (norm_weight, norm_out, x) if v is not None)
    if int4:
        z = weight.zero if weight.zero is not None else weight.scale
        _w4a16_kernel[grid](x, weight.data.view(torch.int16), weight.scale, z, b, out, ws,
                            counters, res, nw, g_out, ss_out, ss_in, pf[0], m, n, k, k // 4,
                            k_per_split, x.stride(0), weight.scale.stride(1), z.stride(1),
                            res.stride(0), n_ss, pf[1], eps, GROUP=group,
                            HAS_ZERO=weight.zero is not None, ASM=not _INTERPRET, **meta)
    else:
        r = residual if residual is not None else x
        one_pass = t.one_pass_norm and norm_weight is not None and split == 1
        _w8a16_kernel[grid](x, r, nw, summed, weight.data, weight.scale, b, out, ws, counters,
                            res, g_out, ss_out, ss_in, pf[0], m, n, k, k_per_split,
                            x.stride(0), r.stride(0), res.stride(0), n_ss, pf[1], eps,
                            NORM=norm_weight is not None,
                            HAS_RES=residual is not None, GATED=gated,
                            DOT=config.block_m > 1, UPCAST=_INTERPRET, ONE_PASS=one_pass,
                            **meta)
    if norm_out is not None:
        return out, summed, g, ss
    return out, summed


def linear_quant(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 config: LinearConfig | None = None, t: QuantLinearTuning = _TUNING,
                 prefetch=None, prefetch_bytes: int = 0) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, N] in x's dtype. config: a forced tile (tests);
    its split_k is the K split. prefetch, prefetch_bytes (here and below): the L2 hint for
    the next projection's weight (_launch)."""
    warm = dict(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    if config is None and takes_w8a8(x, weight, t):
        q, scale, _ = quantize_rows(x)
        return matmul_rows(q, scale, weight, bias, x.dtype, t, **warm)
    if not supported(x, weight, t.max_rows if config is None else x.shape[0]):
        if supported(x, weight, x.shape[0]):  # many rows: the dense GEMM on a one-pass copy
            return F.linear(x, dequantize(weight, x.dtype, t), bias)
        return linear_quant_ref(x, weight, bias)
    return _launch(x, weight, bias, config, t, **warm)[0]


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
    """fp8 takes the prologue in the kernel up to t.fuse_max_rows rows (or with a forced
    config): above, every program re-reading the rows costs more than the separate kernel it
    saves. int4 never: its one row is a 16-row tile, and every program would compute the
    prologue for 16 rows (llama-8b's int4 step at one row took 7.94 ms with the norm fused,
    4.74 ms without; with silu * mul fused, 3.364 / 3.839 / 7.712 ms at batch 1 / 16 / 64
    against 3.065 / 3.736 / 5.477, on an H100)."""
    return weight.format == "fp8" and (config is not None or x.shape[0] <= t.fuse_max_rows)


def norm_linear_quant(x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float, weight: QuantizedWeight,
                      bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                      t: QuantLinearTuning = _TUNING, prefetch=None, prefetch_bytes: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear_quant(rms_norm(x + residual)), x + residual): one kernel at one row, else the
    norm kernel then linear_quant (W8A8: the norm kernel quantizes its rows). Reference:
    linear_quant.norm_linear_quant_ref."""
    warm = dict(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    if (config is None and takes_w8a8(x, weight, t)
            and (residual is None or residual.shape == x.shape)
            and all(v.dtype == x.dtype and v.is_contiguous()
                    for v in (residual, norm_weight) if v is not None)):
        q, scale, summed = quantize_rows(x, residual, norm_weight, eps)
        return matmul_rows(q, scale, weight, bias, x.dtype, t, **warm), summed
    if (not _fuses(x, weight, config, t) or not supported(x, weight, x.shape[0], 1, residual,
                                                  norm_weight)
            or (residual is not None and residual.shape != x.shape)):
        from .linear_triton import _norm

        normed, summed = _norm(x, residual, norm_weight, eps)
        return linear_quant(normed, weight, bias, config, t, **warm), summed
    return _launch(x, weight, bias, config, t, residual, norm_weight, eps, **warm)


def silu_mul_linear_quant(gate_up: torch.Tensor, weight: QuantizedWeight,
                          bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                          t: QuantLinearTuning = _TUNING, prefetch=None,
                          prefetch_bytes: int = 0) -> torch.Tensor:
    """linear_quant(silu(gate) * up): the activation in the kernel's prologue (_fuses), else
    the activation kernel then linear_quant (W8A8: silu * up quantized in one kernel).
    Reference: linear_quant.silu_mul_linear_quant_ref."""
    warm = dict(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    if config is None and takes_w8a8(gate_up, weight, t, gated=True):
        q, scale, _ = quantize_rows(gate_up, gated=True)
        return matmul_rows(q, scale, weight, bias, gate_up.dtype, t, **warm)
    if (not _fuses(gate_up, weight, config, t)
            or not supported(gate_up, weight, gate_up.shape[0], 2)):
        from .activation_triton import silu_mul

        return linear_quant(silu_mul(gate_up), weight, bias, config, t, **warm)
    return _launch(gate_up, weight, bias, config, t, gated=True, **warm)[0]


def takes_epilogue(x: torch.Tensor, weight: QuantizedWeight, width: int = 1,
                   t: QuantLinearTuning = _TUNING) -> bool:
    """Whether these rows run the W8A16 / W4A16 kernel, whose epilogue can add the residual
    and begin the next norm (not W8A8, the dense GEMM or the reference). width: as
    supported's."""
    return (not takes_w8a8(x, weight, t, gated=width == 2)
            and supported(x, weight, t.max_rows, width))


def linear_quant_add(x: torch.Tensor, weight: QuantizedWeight, residual: torch.Tensor,
                     next_norm: torch.Tensor | None = None, gated: bool = False,
                     t: QuantLinearTuning = _TUNING, prefetch=None, prefetch_bytes: int = 0
                     ) -> torch.Tensor | Prenormed:
    """The projection of x (of silu(gate) * up when gated, x being [gate | up]) plus the
    residual stream, the add in the kernel's epilogue: o and down. next_norm: the weight of
    the RMSNorm after it; the result is then a Prenormed. Where the kernel does not take the
    rows (takes_epilogue), the projection and a plain add."""
    warm = dict(prefetch=prefetch, prefetch_bytes=prefetch_bytes)
    if not takes_epilogue(x, weight, 2 if gated else 1, t) or (
            residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype
            or residual.stride(-1) != 1 or next_norm is not None and not next_norm.is_contiguous()):
        h = (silu_mul_linear_quant(x, weight, t=t, **warm) if gated
             else linear_quant(x, weight, t=t, **warm))
        return h + residual
    if gated and not _fuses(x, weight, None, t):
        from .activation_triton import silu_mul

        x, gated = silu_mul(x), False
    out = _launch(x, weight, None, None, t, gated=gated, res_out=residual, norm_out=next_norm,
                  **warm)
    return out[0] if next_norm is None else Prenormed(out[0], out[2], out[3], next_norm)


def prenormed_linear_quant(p: Prenormed, eps: float, weight: QuantizedWeight,
                           bias: torch.Tensor | None = None, t: QuantLinearTuning = _TUNING,
                           prefetch=None, prefetch_bytes: int = 0) -> torch.Tensor:
    """The projection of rms_norm(p.h) by p.norm_weight from its Prenormed form: p.g as the
    input, 1 / rms from p.ss scaling the sums; where the kernel does not take the rows, the
    norm and the projection (norm_linear_quant)."""
    if not takes_epilogue(p.g, weight, 1, t) or bias is not None and not bias.is_contiguous():
        return norm_linear_quant(p.h, None, p.norm_weight, eps, weight, bias, t=t,
                                 prefetch=prefetch, prefetch_bytes=prefetch_bytes)[0]
    return _launch(p.g, weight, bias, None, t, eps=eps, row_scale=p.ss, prefetch=prefetch,
                   prefetch_bytes=prefetch_bytes)[0]
