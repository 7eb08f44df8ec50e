"""Triton mask_stop_tokens: the same result as kernels/sampling.py `mask_stop_tokens_ref` in one
launch. The reference takes about eight small torch kernels (compare, clamp, where, the fill
values, a dtype copy, scatter_reduce), every decode step, whether or not any row has a
min_tokens floor: at batch 1 on llama-1b they were about 12 us of a 1.1 ms step."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _mask_stop_kernel(logits_ptr, stride_b, stop_ptr, stride_s, steps_ptr, stride_steps,
                      min_ptr, stride_min, V, S, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    if tl.load(steps_ptr + b * stride_steps) < tl.load(min_ptr + b * stride_min):
        s = tl.arange(0, BLOCK_S)
        ids = tl.load(stop_ptr + b * stride_s + s, mask=s < S, other=-1).to(tl.int64)
        # -1 pads the row's list; an id past the vocabulary is refused when the request is
        # added, and is skipped here rather than written out of bounds
        ok = (ids >= 0) & (ids < V)
        tl.store(logits_ptr + b * stride_b + ids, float("-inf"), mask=ok)


def mask_stop_tokens(logits: torch.Tensor, stop_ids: torch.Tensor, steps: torch.Tensor,
                     min_tokens: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rows whose step is below their min_tokens may not emit any id of stop_ids[row] (padded
    with -1): those logits become -inf. `inplace` writes into `logits` itself."""
    out = logits if inplace else logits.clone()
    b, v = out.shape
    if b == 0 or stop_ids.shape[1] == 0:
        return out
    if out.stride(-1) != 1 or stop_ids.stride(-1) != 1:
        from .sampling import mask_stop_tokens_ref
        return mask_stop_tokens_ref(out, stop_ids, steps, min_tokens, inplace=True)
    s = stop_ids.shape[1]
    dependent = pdl.enabled(out)
    # steps / min_tokens may be strided or broadcast views (stride 0: one row's values for
    # every logits row, as the speculative verify passes them)
    _mask_stop_kernel[(b,)](out, out.stride(0), stop_ids, stop_ids.stride(0), steps,
                            steps.stride(0), min_tokens, min_tokens.stride(0), v, s,
                            BLOCK_S=max(2, triton.next_power_of_2(s)), PDL=dependent,
                            num_warps=1, launch_pdl=dependent)
    return out
