"""Triton penalties, logit bias, min_p and token counts: the same results as kernels/penalties.py,
one launch each, whose programs for rows without a penalty slot (slot 0) return at once. Only
steps whose batch holds a penalised row run them (the `penalties` variant, graphexec/plan.py).

Penalties take one program per (row, block of the vocabulary): a row's logits, counts and
prompt mask are read once and its logits written once. The logit bias takes one program per
row over its <= 300 pairs. min_p takes one program per row, two passes over it (its maximum
after temperature, then the mask)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .tuning import DEFAULT, SamplingTuning


@triton.jit
def _bias_kernel(logits_ptr, stride_b, slots_ptr, ids_ptr, vals_ptr, stride_s, N,
                 BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot > 0:
        j = tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + slot * stride_s + j, mask=j < N, other=-1).to(tl.int64)
        vals = tl.load(vals_ptr + slot * stride_s + j, mask=j < N, other=0.0)
        on = ids >= 0
        ptr = logits_ptr + b * stride_b + ids
        x = tl.load(ptr, mask=on, other=0.0).to(tl.float32)
        tl.store(ptr, (x + vals).to(logits_ptr.dtype.element_ty), mask=on)


def apply_logit_bias(logits: torch.Tensor, slots: torch.Tensor, bias_ids: torch.Tensor,
                     bias_vals: torch.Tensor) -> torch.Tensor:
    b = logits.shape[0]
    if b == 0:
        return logits
    n = bias_ids.shape[1]
    dependent = pdl.enabled(logits)
    _bias_kernel[(b,)](logits, logits.stride(0), slots, bias_ids, bias_vals, bias_ids.stride(0),
                       n, BLOCK=triton.next_power_of_2(max(n, 2)), PDL=dependent,
                       num_warps=1, launch_pdl=dependent)
    return logits


@triton.jit
def _penalty_kernel(logits_ptr, stride_b, slots_ptr, counts_ptr, prompt_ptr, stride_c,
                    presence_ptr, frequency_ptr, repetition_ptr, V,
                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if slot > 0:
        rep = tl.load(repetition_ptr + slot)
        freq = tl.load(frequency_ptr + slot)
        pres = tl.load(presence_ptr + slot)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < V
        ptr = logits_ptr + b * stride_b + offs
        x = tl.load(ptr, mask=inb, other=0.0).to(tl.float32)
        cnt = tl.load(counts_ptr + slot * stride_c + offs, mask=inb, other=0).to(tl.float32)
        seen = (tl.load(prompt_ptr + slot * stride_c + offs, mask=inb, other=0) != 0) | (cnt > 0)
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, tl.zeros_like(x) + rep), x * rep), x)
        f = freq * cnt
        x = x - f
        p = pres * (cnt > 0).to(tl.float32)
        x = x - p
        tl.store(ptr, x.to(logits_ptr.dtype.element_ty), mask=inb)


def row_blocks(logits: torch.Tensor, tuning: SamplingTuning) -> dict | None:
    """The launch of a kernel over (row, block of the vocabulary) programs: its grid and launch
    options; None for no rows."""
    b, v = logits.shape
    if b == 0:
        return None
    dependent = pdl.enabled(logits)
    return dict(grid=(b, triton.cdiv(v, tuning.penalty_block)), BLOCK=tuning.penalty_block,
                PDL=dependent, num_warps=tuning.penalty_warps, launch_pdl=dependent)


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    prompt_mask: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor, *,
                    tuning: SamplingTuning = DEFAULT.sampling) -> torch.Tensor:
    launch = row_blocks(logits, tuning)
    if launch is None:
        return logits
    grid = launch.pop("grid")
    # the mask is read as bytes: a bool tensor viewed as uint8 (same storage)
    _penalty_kernel[grid](logits, logits.stride(0), slots, counts, prompt_mask.view(torch.uint8),
                          counts.stride(0), presence, frequency, repetition, logits.shape[1],
                          **launch)
    return logits


@triton.jit
def _min_p_kernel(logits_ptr, stride_b, slots_ptr, temp_ptr, log_min_p_ptr, V,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    t = tl.load(temp_ptr + b)
    if (slot > 0) & (t > 0):
        lmp = tl.load(log_min_p_ptr + slot)
        if lmp > float("-inf"):
            row = logits_ptr + b * stride_b
            ar = tl.arange(0, BLOCK)
            m = tl.full([BLOCK], float("-inf"), tl.float32)
            for off in range(0, V, BLOCK):
                x = tl.load(row + off + ar, mask=off + ar < V, other=float("-inf"))
                m = tl.maximum(m, tl.math.div_rn(x.to(tl.float32), tl.zeros_like(m) + t))
            floor = tl.max(m, 0) + lmp
            for off in range(0, V, BLOCK):
                inb = off + ar < V
                x = tl.load(row + off + ar, mask=inb, other=float("-inf")).to(tl.float32)
                drop = tl.math.div_rn(x, tl.zeros_like(x) + t) < floor
                tl.store(row + off + ar, tl.full([BLOCK], float("-inf"), tl.float32)
                         .to(logits_ptr.dtype.element_ty), mask=inb & drop)


def apply_min_p(logits: torch.Tensor, slots: torch.Tensor, temperature: torch.Tensor,
                log_min_p: torch.Tensor, *,
                tuning: SamplingTuning = DEFAULT.sampling) -> torch.Tensor:
    b, v = logits.shape
    if b == 0:
        return logits
    dependent = pdl.enabled(logits)
    _min_p_kernel[(b,)](logits, logits.stride(0), slots, temperature, log_min_p, v,
                        BLOCK=tuning.penalty_block, PDL=dependent,
                        num_warps=tuning.penalty_warps, launch_pdl=dependent)
    return logits


@triton.jit
def _count_kernel(counts_ptr, stride_c, slots_ptr, tokens_ptr, live_ptr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b)
    if (slot > 0) & (tl.load(live_ptr + b) != 0):
        ptr = counts_ptr + slot * stride_c + tl.load(tokens_ptr + b)
        tl.store(ptr, tl.load(ptr) + 1)


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                 live: torch.Tensor) -> None:
    b = slots.shape[0]
    if b == 0:
        return
    dependent = pdl.enabled(counts)
    _count_kernel[(b,)](counts, counts.stride(0), slots, tokens, live.view(torch.uint8),
                        PDL=dependent, num_warps=1, launch_pdl=dependent)
