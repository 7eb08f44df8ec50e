"""Triton penalties, logit bias, min_p and token counts: the same results as kernels/penalties.py,
one launch each, whose programs for rows without a penalty slot (slot 0) return at once. Only
steps whose batch holds a penalised row run them (the `penalties` variant, graphexec/plan.py).

Penalties take one program per row, over its slot's list of seen tokens (prompt and generated,
each listed once): it gathers their logits, counts and prompt flags, and scatters the penalised
logits back, so a step costs what the rows have seen, not the vocabulary. The token counts take
one program per row, which also appends a token seen for the first time to its slot's list. The
logit bias takes one program per row over its <= 300 pairs. min_p takes one program per row,
two passes over it (its maximum after temperature, then the mask)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .penalties import IN_PROMPT, LISTED
from .row_vectors import check_dense
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
    check_dense(slots)
    n = bias_ids.shape[1]
    dependent = pdl.enabled(logits)
    _bias_kernel[(b,)](logits, logits.stride(0), slots, bias_ids, bias_vals, bias_ids.stride(0),
                       n, BLOCK=triton.next_power_of_2(max(n, 2)), PDL=dependent,
                       num_warps=1, launch_pdl=dependent)
    return logits


@triton.jit
def _penalty_kernel(logits_ptr, stride_b, slots_ptr, counts_ptr, flags_ptr, seen_ptr, stride_s,
                    num_seen_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                    IN_PROMPT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot > 0:
        rep = tl.load(repetition_ptr + slot)
        freq = tl.load(frequency_ptr + slot)
        pres = tl.load(presence_ptr + slot)
        n = tl.load(num_seen_ptr + slot)
        row = logits_ptr + b * stride_b
        at = slot * stride_s  # the slot's row of counts, flags and list
        for off in range(0, n, BLOCK):
            j = off + tl.arange(0, BLOCK)
            on = j < n
            # distinct tokens: no two lanes write one logit
            tok = tl.load(seen_ptr + at + j, mask=on, other=0).to(tl.int64)
            x = tl.load(row + tok, mask=on, other=0.0).to(tl.float32)
            cnt = tl.load(counts_ptr + at + tok, mask=on, other=0).to(tl.float32)
            prompt = (tl.load(flags_ptr + at + tok, mask=on, other=0) & IN_PROMPT) != 0
            x = tl.where(prompt | (cnt > 0),
                         tl.where(x > 0, tl.math.div_rn(x, tl.zeros_like(x) + rep), x * rep), x)
            # frequency and presence only where counted, as the reference: a listed token back
            # at count 0 (a rejected draft) is not charged
            x = tl.where(cnt > 0, x - freq * cnt - pres, x)
            tl.store(row + tok, x.to(logits_ptr.dtype.element_ty), mask=on)


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    flags: torch.Tensor, seen_ids: torch.Tensor, num_seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                    *, tuning: SamplingTuning = DEFAULT.sampling) -> torch.Tensor:
    b = logits.shape[0]
    if b == 0:
        return logits
    # the kernel takes one row stride for the three [S, V] tensors
    assert counts.stride(0) == flags.stride(0) == seen_ids.stride(0)
    check_dense(slots)
    dependent = pdl.enabled(logits)
    # enable_fp_fusion=False: count * frequency is rounded before it is subtracted, as torch
    # does, so the logits equal the reference's bit for bit (no fused multiply-add)
    _penalty_kernel[(b,)](logits, logits.stride(0), slots, counts, flags, seen_ids,
                          counts.stride(0), num_seen, presence, frequency, repetition,
                          IN_PROMPT=IN_PROMPT, BLOCK=tuning.penalty_list_block, PDL=dependent,
                          num_warps=tuning.penalty_warps, launch_pdl=dependent,
                          enable_fp_fusion=False)
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
    check_dense(slots, temperature)
    dependent = pdl.enabled(logits)
    _min_p_kernel[(b,)](logits, logits.stride(0), slots, temperature, log_min_p, v,
                        BLOCK=tuning.penalty_block, PDL=dependent,
                        num_warps=tuning.penalty_warps, launch_pdl=dependent)
    return logits


@triton.jit
def _count_kernel(counts_ptr, flags_ptr, seen_ptr, stride_s, num_seen_ptr, slots_ptr, tokens_ptr,
                  live_ptr, LISTED: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if (slot > 0) & (tl.load(live_ptr + b) != 0):
        tok = tl.load(tokens_ptr + b)
        at = slot * stride_s + tok
        tl.store(counts_ptr + at, tl.load(counts_ptr + at) + 1)
        # one program per slot: nothing else appends to this list meanwhile
        f = tl.load(flags_ptr + at)
        if (f & LISTED) == 0:
            n = tl.load(num_seen_ptr + slot)
            tl.store(seen_ptr + slot * stride_s + n, tok.to(seen_ptr.dtype.element_ty))
            tl.store(num_seen_ptr + slot, n + 1)
            tl.store(flags_ptr + at, f | LISTED)


def count_tokens(counts: torch.Tensor, flags: torch.Tensor, seen_ids: torch.Tensor,
                 num_seen: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                 live: torch.Tensor) -> None:
    b = slots.shape[0]
    if b == 0:
        return
    assert counts.stride(0) == flags.stride(0) == seen_ids.stride(0)
    check_dense(slots, tokens, live)
    dependent = pdl.enabled(counts)
    _count_kernel[(b,)](counts, flags, seen_ids, counts.stride(0), num_seen, slots, tokens,
                        live.view(torch.uint8), LISTED=LISTED, PDL=dependent, num_warps=1,
                        launch_pdl=dependent)
