"""Triton wait for a step's grammar masks: the same result as kernels/mask_gate.py, but the
device waits for the host's flag instead of requiring it.

One program per row. A row in use polls the flag in pinned host memory (volatile loads, so
every poll crosses the bus, reduced over the program so its warps leave the loop together) until
it reaches the step's ticket, then copies its grammar flag, and its mask words if the flag is
set, from pinned memory to the device. Programs past the rows in use return at once, so the grid
is sized for the largest batch and captured.

Deadline: a wait that outlasts timeout_s traps, as the all-reduce's does
(kernels/all_reduce_triton.py). The host releases each step's masks right after reading the
step before, so only a host that stopped (a bug, a process torn down mid-step) gets there; the
failed CUDA context makes the engine raise at its next step, rather than sample under stale
masks or hang the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .all_reduce_triton import _now_ns, _trap
from .tuning import DEFAULT, SamplingTuning

TIMEOUT_S = 60.0


@triton.jit
def _await_masks_kernel(flag_ptr, passed_ptr, num_rows_ptr, src_ptr, dst_ptr, row_words,
                        timeout_ns, BLOCK: tl.constexpr, THREADS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row < tl.load(num_rows_ptr):
        ticket = tl.load(passed_ptr) + 1
        lanes = tl.arange(0, THREADS)
        seen = tl.min(tl.load(flag_ptr + lanes * 0, volatile=True), axis=0)
        late = tl.full([], 0, tl.int32)
        deadline = tl.full([], 0, tl.int64)  # set at the first poll that finds it down
        while (seen < ticket) & (late == 0):
            now = _now_ns(THREADS)
            deadline = tl.where(deadline == 0, now + timeout_ns, deadline)
            late = (now > deadline).to(tl.int32)
            seen = tl.min(tl.load(flag_ptr + lanes * 0, volatile=True), axis=0)
        if seen < ticket:
            _trap()
        # volatile: read after the flag, from the bus, never from a cache
        src, dst, mask_words = src_ptr + row * row_words, dst_ptr + row * row_words, row_words - 1
        on = tl.load(src + mask_words, volatile=True)
        tl.store(dst + mask_words, on)
        if on != 0:
            for start in range(0, mask_words, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inb = offs < mask_words
                words = tl.load(src + offs, mask=inb, other=0, volatile=True)
                tl.store(dst + offs, words, mask=inb)


def await_masks(flag: torch.Tensor, passed: torch.Tensor, num_rows: torch.Tensor,
                src: torch.Tensor, dst: torch.Tensor, *,
                tuning: SamplingTuning = DEFAULT.sampling,
                timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    """flag and src in pinned host memory, passed, num_rows and dst on the device (shapes as
    the reference's)."""
    block, warps = tuning.mask_copy_block, 4
    grid = (dst.shape[0],)
    _await_masks_kernel[grid](flag, passed, num_rows, src, dst, dst.shape[1],
                              int(timeout_s * 1e9), BLOCK=block, THREADS=32 * warps,
                              num_warps=warps)
    passed.add_(1)  # after every program read it
    return dst
