"""The epilogue-fused projections of multi-row decode batches (what op_sets.FusedOps runs
at 33-64 rows), on the kernel of kernels/linear_triton.py: gate_up with silu * mul in its
epilogue, o and down with the residual add in theirs, and the RMSNorm after them split between
the producing and the consuming projection (Prenormed). References: kernels/linear.py,
kernels/activation.py, kernels/rmsnorm.py."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from . import Prenormed, Pushed
from .activation_triton import silu_mul
from .all_reduce_triton import Push
from .gather_triton import Landing
from .linear_triton import LinearConfig, _launch, _split_k, row_limit, supported
from .norm_rope_triton import rms_norm
from .tuning import DEFAULT, LinearTuning

_TUNING = DEFAULT.linear  # what a caller that passes no table gets


def linear_silu(x: torch.Tensor, gate_up: torch.Tensor, config: LinearConfig | None = None,
                max_rows: int | None = None, prefetch: torch.Tensor | None = None,
                prefetch_bytes: int = 0, t: LinearTuning = _TUNING) -> torch.Tensor:
    """silu(gate) * up of x's projection by [gate | up]: the activation in the epilogue.
    prefetch, prefetch_bytes (here and below): that much of the next projection's weight is
    warmed in L2 (linear_triton._launch)."""
    if not supported(x, gate_up, 1, max_rows=row_limit(max_rows, t)) or gate_up.shape[0] % 2:
        return silu_mul(F.linear(x, gate_up))
    return _launch(x, None, None, 0.0, gate_up, None,
                   config or pick_fused_config(x.shape[0], gate_up.shape[0] // 2,
                                               gate_up.shape[1], "gate_up", t), silu_out=True,
                   prefetch=prefetch, prefetch_bytes=prefetch_bytes)[0]


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
               config: LinearConfig | None = None, max_rows: int | None = None,
               next_norm: torch.Tensor | None = None,
               prefetch: torch.Tensor | None = None,
               prefetch_bytes: int = 0, t: LinearTuning = _TUNING) -> torch.Tensor | Prenormed:
    """linear(x) + residual in one kernel (the add in the epilogue, or in the split-K sum):
    the attention output and MLP projections whose result joins the residual stream.
    next_norm: the weight of the RMSNorm after it; the result is then a Prenormed (torch's
    fallback, for operands the kernel does not take, returns the plain sum)."""
    if (not supported(x, weight, 1, residual, next_norm, max_rows=row_limit(max_rows, t))
            or residual.shape != (x.shape[0], weight.shape[0])):
        return F.linear(x, weight) + residual
    out = _launch(x, None, None, 0.0, weight, None,
                  config or pick_fused_config(x.shape[0], *weight.shape, "add", t),
                  res_out=residual, norm_out=next_norm, prefetch=prefetch,
                  prefetch_bytes=prefetch_bytes)
    return out[0] if next_norm is None else Prenormed(out[0], out[2], out[3], next_norm)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None,
                   max_rows: int | None = None, prefetch: torch.Tensor | None = None,
                   prefetch_bytes: int = 0, push: Push | None = None,
                   t: LinearTuning = _TUNING) -> torch.Tensor | Pushed:
    """linear(x) on linear_add's kernel and config, without the add: a tensor-parallel rank's
    partial sum of o or down (the all-reduce after it adds the residual once). push: where
    the kernel runs and the output fits, it also sends the output to the peers (a Pushed
    comes back); torch's fallback does not."""
    if not supported(x, weight, 1, max_rows=row_limit(max_rows, t)):
        return F.linear(x, weight)
    if push is not None and not push.fits(x.shape[0], weight.shape[0], x.dtype):
        push = None
    out = _launch(x, None, None, 0.0, weight, None,
                  config or pick_fused_config(x.shape[0], *weight.shape, "add", t),
                  prefetch=prefetch, prefetch_bytes=prefetch_bytes, push=push)[0]
    return out if push is None else Pushed(out, push.slot)


def linear_gathered(x: torch.Tensor, weight: torch.Tensor, gather: Landing,
                    config: LinearConfig | None = None,
                    max_rows: int | None = None,
                    t: LinearTuning = _TUNING) -> torch.Tensor | None:
    """A tensor-parallel rank's LM head over its vocabulary slice, returning the whole logits
    [rows, world * n]: its own columns computed here, the peers' landed in this rank's zone by
    their LM heads (kernels/gather_triton.py). None where the kernel does not take x or the
    slice does not fit a box (the caller then gathers through NCCL)."""
    m, n = x.shape[0], weight.shape[0]
    if (not supported(x, weight, 1, max_rows=row_limit(max_rows, t))
            or not gather.fits(m, n, x.dtype)):
        return None
    cfg = config or pick_fused_config(m, n, weight.shape[1], "lm_head", t)
    if cfg.split_k != 1:
        return None
    return _launch(x, None, None, 0.0, weight, None, cfg, gather=gather)[0]


def prenormed_linear(p: Prenormed, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                     silu_out: bool = False, max_rows: int | None = None,
                     prefetch: torch.Tensor | None = None,
                     prefetch_bytes: int = 0, t: LinearTuning = _TUNING) -> torch.Tensor:
    """The projection of rms_norm(p.h) (p.norm_weight, eps) from its Prenormed form: p.g as the
    input, 1 / rms in the epilogue. silu_out: the weight is [gate | up] and the result
    silu(gate) * up, as linear_silu."""
    m, k = p.g.shape
    n = weight.shape[0] // 2 if silu_out else weight.shape[0]
    if not supported(p.g, weight, 1, bias, max_rows=row_limit(max_rows, t)) or silu_out and (
            weight.shape[0] % 2 or bias is not None):
        out = F.linear(rms_norm(p.h, p.norm_weight, eps), weight, bias)
        return silu_mul(out) if silu_out else out
    cfg = config or pick_fused_config(m, n, k, "gate_up" if silu_out else "qkv", t)
    return _launch(p.g, None, None, eps, weight, bias, cfg, silu_out=silu_out,
                   row_scale=p.ss, prefetch=prefetch, prefetch_bytes=prefetch_bytes)[0]


def pick_fused_config(m: int, n: int, k: int, kind: str,
                      t: LinearTuning = _TUNING) -> LinearConfig:
    """The tile of an epilogue-fused projection of kind "gate_up" (silu epilogue, n the
    intermediate size), "lm_head", "qkv" or "add" (o and down, residual epilogue), from the
    table t (tools/lab/tune_fused.py measured them): about t.fused_add_programs programs for the
    residual-epilogue projections, the K of the down projection split until there are; qkv
    about t.fused_qkv_programs."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if kind == "gate_up":
        return replace(t.fused_gate_up, block_m=block_m)
    if kind == "lm_head":
        return replace(t.fused_lm_head, block_m=block_m)
    if kind == "qkv":
        block_n = min(64, max(16, triton.next_power_of_2(triton.cdiv(n, t.fused_qkv_programs))))
        return LinearConfig(block_m, block_n, 128, 1, num_warps=4, num_stages=5)
    if k > n:
        split = _split_k(triton.cdiv(n, 64), t.fused_add_programs, k, 128)
        return LinearConfig(block_m, 64, 128, split, num_warps=4, num_stages=5)
    block_n = min(64, max(16, triton.next_power_of_2(triton.cdiv(n, t.fused_add_programs))))
    return LinearConfig(block_m, block_n, 128, 1, num_warps=4, num_stages=5)
