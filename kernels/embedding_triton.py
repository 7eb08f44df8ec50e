"""The token embedding gather as the forward's first kernel, launched as a programmatic
dependent that waits *before* it lets its own dependents launch (kernels/pdl.py). Reference:
kernels/embedding.py.

Why a kernel of our own: the kernels after it read, before their own PDL wait, what was written
before the forward began (the fused attention prefetches the step's metadata and earlier KV).
That is safe when the forward's first kernel lets nothing after it start until everything
before it is complete. A normal launch (torch's gather) gives that, at the price of a full drain
and launch between the step's previous kernel and the first projection. Here each program waits
for the previous kernel first and only then signals: the first projection still starts only
after everything before the forward is complete, but the gather's launch and the projection's
weight prefetch overlap the kernel before."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .embedding import embedding_ref


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the order matters: see the module docstring
        pdl.gdc_wait()
        pdl.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    row = tl.load(ids_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * H + cols, tl.load(w_ptr + row * H + cols, mask=ok), mask=ok)


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests replace it to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as embedding_ref; ids out of range are the caller's to refuse (the engine
    checks every prompt against the vocabulary)."""
    if not (ids.dim() == 1 and weight.dim() == 2 and ids.is_contiguous()
            and weight.is_contiguous() and ids.device == weight.device):
        return embedding_ref(ids, weight)
    t, h = ids.shape[0], weight.shape[1]
    out = _new((t, h), weight.dtype, weight.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(h))
    dependent = pdl.enabled(weight, projection=False)
    _embedding_kernel[(t, triton.cdiv(h, block))](ids, weight, out, h, BLOCK=block,
                                                  PDL=dependent, num_warps=4,
                                                  launch_pdl=dependent)
    return out
