"""Triton wait for a step's grammar masks: the same result as kernels/mask_gate.py, but the
device waits for the host's flag instead of requiring it.

Two kernels, so that pinned host memory is read as little as it can be: every read of it
crosses PCIe. One program of one warp polls the flag (volatile
loads: every poll crosses the bus) until it reaches the step's ticket, then copies each row's
grammar flag, one read a row. Then one program per row copies the mask words of rows whose flag
is set, in wide reads. Programs past the rows in use return at once, so the grid is sized for the
largest batch and captured. A single kernel with one program per row, each polling with all its
lanes, took 256 us with the flag already up for 64 rows on an H200, against 3 us with the flag in
device memory: the polls, not the masks, were the time.

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
def _await_flag_kernel(flag_ptr, passed_ptr, num_rows_ptr, flags_ptr, dst_ptr, row_words,
                       timeout_ns, ROWS: tl.constexpr, THREADS: tl.constexpr):
    """Waits for the step's ticket, then copies the grammar flag of every row in use."""
    n = tl.load(num_rows_ptr)
    if n > 0:
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
        rows = tl.arange(0, ROWS)
        # volatile: read after the flag, from the bus, never from a cache
        on = tl.load(flags_ptr + rows, mask=rows < n, other=0, volatile=True)
        tl.store(dst_ptr + rows.to(tl.int64) * row_words + row_words - 1, on, mask=rows < n)


@triton.jit
def _copy_masks_kernel(num_rows_ptr, src_ptr, dst_ptr, words_ptr, row_words, dst_stride,
                       n_words, BLOCK: tl.constexpr):
    """Row program_id's mask if the flag _await_flag_kernel copied into dst is set: n_words
    words from src (its host row, n_words apart) to words_ptr (the same device row seen as
    words of src's size; the row's last int64 is the flag)."""
    row = tl.program_id(0).to(tl.int64)
    if row < tl.load(num_rows_ptr):
        if tl.load(dst_ptr + row * row_words + row_words - 1) != 0:
            src, dst = src_ptr + row * n_words, words_ptr + row * dst_stride
            for start in range(0, n_words, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inb = offs < n_words
                words = tl.load(src + offs, mask=inb, other=0, volatile=True)
                tl.store(dst + offs, words, mask=inb)


def await_masks(flag: torch.Tensor, passed: torch.Tensor, num_rows: torch.Tensor,
                masks: torch.Tensor, flags: torch.Tensor, dst: torch.Tensor, *,
                tuning: SamplingTuning = DEFAULT.sampling,
                timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    """flag, masks and flags in pinned host memory, passed, num_rows and dst on the device
    (shapes as the reference's)."""
    rows, row_words = dst.shape
    _await_flag_kernel[(1,)](flag, passed, num_rows, flags, dst, row_words, int(timeout_s * 1e9),
                             ROWS=triton.next_power_of_2(rows), THREADS=32, num_warps=1)
    mask_words = masks.shape[1]
    if mask_words % 2 == 0:  # as int64 words: half the loads across the bus
        src, words, n, dst_stride = masks.view(torch.int64), dst, mask_words // 2, row_words
    else:
        src, words, n, dst_stride = masks, dst.view(torch.int32), mask_words, 2 * row_words
    _copy_masks_kernel[(rows,)](num_rows, src, dst, words, row_words, dst_stride, n,
                                BLOCK=tuning.mask_copy_block, num_warps=4)
    passed.add_(1)  # after the wait read it
    return dst
