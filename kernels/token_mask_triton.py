"""Triton grammar token masks: the same result as kernels/token_mask.py, one launch, one program
per (row, block of the vocabulary); a row without a grammar returns at once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .tuning import DEFAULT, SamplingTuning


@triton.jit
def _token_mask_kernel(logits_ptr, stride_b, mask_ptr, stride_m, on_ptr, stride_on, V,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    if tl.load(on_ptr + b * stride_on) != 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < V
        words = tl.load(mask_ptr + b * stride_m + offs // 32, mask=inb, other=-1)
        drop = ((words >> (offs % 32)) & 1) == 0
        tl.store(logits_ptr + b * stride_b + offs,
                 tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
                 mask=inb & drop)


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, on: torch.Tensor, *,
                     tuning: SamplingTuning = DEFAULT.sampling) -> torch.Tensor:
    b, v = logits.shape
    if b == 0:
        return logits
    on = on.view(torch.uint8) if on.dtype == torch.bool else on
    dependent = pdl.enabled(logits)
    block = tuning.penalty_block
    _token_mask_kernel[(b, triton.cdiv(v, block))](
        logits, logits.stride(0), mask, mask.stride(0), on, on.stride(0), v, BLOCK=block,
        PDL=dependent, num_warps=tuning.penalty_warps, launch_pdl=dependent)
    return logits
