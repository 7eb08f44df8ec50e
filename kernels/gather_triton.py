"""The logits' all-gather of a tensor-parallel step, folded into the LM head's epilogue.

Each rank's LM head computes the logits of its slice of the vocabulary, and sampling needs all
of them on every rank. Through NCCL that is an all-gather after the LM head, then a copy that
interleaves the ranks' slices row by row. Here instead:

- each program of the LM head stores its finished tile twice: into this rank's columns of the
  whole logits, and into this rank's box in every peer's landing zone (mapped symmetric
  memory, plain peer stores over NVLink), while the other programs still stream weights;
- then it makes its stores visible at system scope and adds one to every peer's arrival
  counter (`red.release.sys`: a release, so a peer that sees the count sees the tiles, and a
  reduction, which needs no answer from the link);
- after the LM head, one small program waits until this rank's counter has grown by the
  peers' program count (an acquire), and a copy moves the landed slices into their columns.

Counters only grow; each rank keeps, in its own memory, the count its last wait ended at (the
next wait's start), so a replayed graph needs no reset. A peer's tiles of step k + 1 cannot land
before this rank has copied out those of step k: the peer computes its LM head of step k + 1
only after this rank's all-reduces of step k + 1, which come after the copy on this rank's
stream. That rests on every kernel launched as a programmatic dependent passing its PDL wait
before it finishes (kernels/pdl.py), and on the copy being an ordinary launch. A wait that
outlasts timeout_s traps, as the all-reduce's does (kernels/all_reduce_triton.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .all_reduce_triton import TIMEOUT_S, _now_ns, _trap

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
WAIT_THREADS = 32  # one warp polls


def gather_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """What the gather computes: the ranks' [rows, n] slices side by side, rank order."""
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class Landing:
    """This rank's view of every rank's landing zone: a box of box_bytes per source rank (box q
    for rank q's tiles; a rank's own box stays unused) and an int64 arrival counter per rank.
    landing_ptrs, counter_ptrs: int64 [world], addresses valid in this process (the peers'
    over NVLink); zone (uint8): this rank's own zone as a tensor; waited: int64 [1] in this
    rank's ordinary memory, the count its last wait ended at."""
    rank: int
    world: int
    landing_ptrs: torch.Tensor
    counter_ptrs: torch.Tensor
    zone: torch.Tensor
    waited: torch.Tensor
    box_bytes: int

    def fits(self, rows: int, n: int, dtype: torch.dtype) -> bool:
        """Whether a rank's [rows, n] slice of dtype fits a box (16-bit logits only)."""
        return (dtype in (torch.bfloat16, torch.float16)
                and 0 < rows * n * 2 <= self.box_bytes)

    def box(self, source: int, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank `source`'s landed [rows, n] slice in this rank's zone."""
        start = source * self.box_bytes
        nbytes = rows * n * dtype.itemsize
        return self.zone[start:start + nbytes].view(dtype).view(rows, n)


@triton.jit
def land_tile(h, flat, mask, landing_ptrs, counter_ptrs, box_elems, RANK: tl.constexpr,
              WORLD: tl.constexpr, INTERPRET: tl.constexpr):
    """The LM head epilogue's part: the finished tile h (its elements at flat, [rows, n] dense
    offsets) into this rank's box in every peer's landing zone, then one arrival at each peer's
    counter, released at system scope once every thread of the program has stored."""
    for q in tl.static_range(WORLD):
        if q != RANK:
            # zones start 16-byte aligned (after the all-reduce's area, in 16 MiB boxes):
            # without the hint the peer's tile went out in 2-byte stores
            zone = tl.multiple_of(tl.load(landing_ptrs + q).to(tl.pointer_type(h.dtype)), 16)
            tl.store(zone + RANK * box_elems + flat, h, mask=mask)
    tl.debug_barrier()
    for q in tl.static_range(WORLD):
        if q != RANK:
            counter = tl.load(counter_ptrs + q) + tl.zeros([1], tl.int64)
            if INTERPRET:
                tl.atomic_add(counter.to(tl.pointer_type(tl.int64)), 1)
            else:
                # one thread adds; the barrier above orders the others' stores before it, and
                # the release makes them visible with the count
                tl.inline_asm_elementwise(
                    "{ .reg .pred first; .reg .u32 tid; mov.u32 tid, %tid.x;"
                    " setp.eq.u32 first, tid, 0;"
                    " @first red.release.sys.global.add.u64 [$1], 1; mov.u32 $0, 0; }",
                    "=r,l", [counter], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_acquire(address, THREADS: tl.constexpr, INTERPRET: tl.constexpr):
    """The int64 at address (an int64), read by every thread with acquire semantics at system
    scope; the smallest value any thread saw, so the program agrees on one."""
    if INTERPRET:
        ptr = address.to(tl.pointer_type(tl.int64))
        v = tl.load(ptr + tl.zeros([THREADS], tl.int32), volatile=True)
    else:
        addr = address + tl.zeros([THREADS], tl.int64)
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [addr],
                                      dtype=tl.int64, is_pure=False, pack=1)
    return tl.min(v, axis=0)


@triton.jit
def _wait_kernel(counter_ptrs, waited_ptr, arrivals, timeout_ns, RANK: tl.constexpr,
                 TIMED: tl.constexpr, THREADS: tl.constexpr, INTERPRET: tl.constexpr,
                 PDL: tl.constexpr):
    # One program: waits until this rank's counter reaches the last wait's count plus the
    # peers' arrivals of this gather, then records that count for the next wait.
    pdl.prologue(PDL)
    counter_ptr = tl.load(counter_ptrs + RANK)
    target = tl.load(waited_ptr) + arrivals
    late = tl.full([], 0, tl.int32)
    deadline = tl.full([], 0, tl.int64)
    got = _load_acquire(counter_ptr, THREADS, INTERPRET)
    while (got < target) & (late == 0):
        got = _load_acquire(counter_ptr, THREADS, INTERPRET)
        if TIMED:
            now = _now_ns(THREADS)
            deadline = tl.where(deadline == 0, now + timeout_ns, deadline)
            late = ((got < target) & (now > deadline)).to(tl.int32)
    if late > 0:
        _trap()
    tl.store(waited_ptr, target)


def wait_and_place(landing: Landing, full: torch.Tensor, programs: int,
                   timeout_s: float = TIMEOUT_S) -> None:
    """After an LM head whose `programs` programs (as many on every rank) landed their tiles
    (land_tile) and stored this rank's columns of full ([rows, world * n]): waits for the
    peers' tiles, then copies each peer's slice from its box into its columns."""
    rows, n = full.shape[0], full.shape[1] // landing.world
    dependent = pdl.enabled(full)
    _wait_kernel[(1,)](landing.counter_ptrs, landing.waited, programs * (landing.world - 1),
                       int(timeout_s * 1e9), RANK=landing.rank, TIMED=not _INTERPRET,
                       THREADS=WAIT_THREADS,
                       INTERPRET=_INTERPRET, PDL=dependent, num_warps=1,
                       launch_pdl=dependent)
    for q in range(landing.world):
        if q != landing.rank:
            full[:, q * n:(q + 1) * n].copy_(landing.box(q, rows, n, full.dtype))
