"""The decode step's results written by the GPU straight into pinned host memory.

A D2H copy enqueued after each graph replay left a gap between replays several times longer
than the copy itself (docs/architecture.md gives the figures). Pinned host memory is mapped
into the GPU's address space (unified addressing), so the last kernel of the captured iteration
can store the results there itself, and the graph runs into the next one with nothing between
them.

The host cannot tell a replayed graph where to write without a copy per step, so the slot is
chosen on the device: a counter in device memory, advanced by every launch of this kernel. The
host mirrors it (capture/results.py, ResultRing.take). Reference: kernels/publish.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _publish_kernel(src_ptr, ring_ptr, counter_ptr, n, slot_elems, num_slots,
                    BLOCK: tl.constexpr):
    count = tl.load(counter_ptr)
    base = ring_ptr + (count % num_slots) * slot_elems
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(base + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)
    tl.store(counter_ptr, count + 1)


def publish(src: torch.Tensor, ring: torch.Tensor, counter: torch.Tensor) -> None:
    """As kernels/publish.py: ring[counter % R, :len(src)] = src; counter += 1. One program:
    a step's results are a few KiB at most, and the counter needs one reader and writer."""
    if src.dtype != ring.dtype or not src.is_contiguous() or not ring.is_contiguous():
        raise ValueError(f"publish: src and ring must be contiguous and of one dtype, got "
                         f"src={src.dtype}, ring={ring.dtype}")
    if src.shape[1:] != ring.shape[2:] or src.shape[0] > ring.shape[1]:
        raise ValueError(f"publish: src of shape {tuple(src.shape)} does not fit a slot of "
                         f"ring shape {tuple(ring.shape)}")
    n = src.numel()
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    _publish_kernel[(1,)](src, ring, counter, n, ring[0].numel(), ring.shape[0], BLOCK=block)
