"""A one-shot all-reduce of a decode step's partial sums over symmetric memory, in Triton.

Each rank's o and down projections return a partial sum of a few kilobytes (a hidden state per
row) that the ranks must add up before the next norm. NCCL's all-reduce of such a message is
all protocol and no data (about 6.6 us on two H100s), it launches as an ordinary kernel, so the
kernel after it cannot start early, and HBM idles while it runs. This kernel:

- launches as a programmatic dependent (kernels/pdl.py) and lets the next projection launch
  as soon as it has started, so that projection fetches its first weight tiles during the
  exchange;
- copies this rank's partial into its slot of a buffer that every rank mapped (symmetric
  memory: parallel/symmetric.py), raises a flag in each peer's flag area, waits for each
  peer's flag in its own, and reads the peers' partials over NVLink (plain peer loads, no
  multicast);
- sums the ranks' parts in rank order in fp32 and rounds once, so every rank gets the same bits
  (at two ranks, NCCL's bits too).

Tried and dropped: spare programs warming L2 with the next projection's weight during the
exchange (kernels/l2_prefetch.py). On two H200s (llama-8b, 2026-11-26, docs/benchmarks.md
"Tensor parallelism") 8 MiB made the batch-1 step slower (2.851 against 2.763 ms), and 2 or
4 MiB were no faster than none (2.817 and 2.842 against 2.799 ms): the next projection,
launched early, already fetches its first tiles during the exchange.

Flags: program p of rank r raises flag [p, r] in every peer's area with a compare-and-swap of 0
to 1 (release, system scope), and takes flag [p, q] in its own area for each peer q by swapping
1 back to 0 (acquire). A rank that is a whole all-reduce ahead waits at the raise until the
peer has taken the previous flag, so the flags need no epoch and a captured graph replays them
as they are.

Slots: a rank may leave all-reduce k while a peer still reads its slot for k, so all-reduce k + 1
writes the other slot; by all-reduce k + 2 the peer has raised its flag for k + 1, which it
does only after finishing k (the kernels of a stream complete in order). The model alternates
the slots by site (o: 0, down: 1), which holds across forwards and graphs alike, since every
forward runs o, down, o, down, ...
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Elements of the message each program exchanges: 4 KiB of bf16, two 16-byte loads per thread
# and part, at four warps.
BLOCK = 2048
NUM_WARPS = 4
# Flags in each rank's area: one per (program, rank) at most; a message of more than
# MAX_PROGRAMS * BLOCK elements goes to NCCL.
MAX_PROGRAMS = 1024
MAX_WORLD = 8
FLAG_BYTES = MAX_PROGRAMS * MAX_WORLD * 4  # int32 flags; keeps the slots after it 16-aligned
# A peer that has not raised its flag by then is dead or hung: the kernel traps, which fails
# the CUDA context, so the engine raises at its next step instead of summing a stale slot (as
# NCCL's watchdog ends a stuck collective). The first forward of a rank may wait for its
# peer's Triton compilation, hence the minute.
TIMEOUT_S = 60.0


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum the kernel computes: every rank's part in rank order, in fp32, rounded once."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(parts[0].dtype)


@triton.jit
def _now_ns(THREADS: tl.constexpr):
    """The GPU's global timer in ns, one value for the whole program: each of its THREADS
    threads reads the clock, and a reduction across the warps takes the latest. A wait loop
    tests it, and warps that left the loop at different times would hang at the next barrier
    without the others."""
    lanes = tl.arange(0, THREADS)
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lanes],
                                  dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _swap_when(ptr, expected, value, SEM: tl.constexpr, deadline, TIMED: tl.constexpr,
               THREADS: tl.constexpr):
    """Compare-and-swap expected -> value (system scope) until it succeeds; 1 if the deadline
    passed first, else 0. A scalar atomic runs in one thread and its result reaches all, so
    every thread leaves the loop together."""
    seen = tl.atomic_cas(ptr, expected, value, sem=SEM, scope="sys")
    late = tl.full([], 0, tl.int32)
    while (seen != expected) & (late == 0):
        seen = tl.atomic_cas(ptr, expected, value, sem=SEM, scope="sys")
        if TIMED:
            late = ((seen != expected) & (_now_ns(THREADS) > deadline)).to(tl.int32)
    return late


@triton.jit
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, data_ptrs, flag_ptrs, n, slot_offset,
                                timeout_ns, RANK: tl.constexpr, WORLD: tl.constexpr,
                                BLOCK: tl.constexpr, TIMED: tl.constexpr,
                                THREADS: tl.constexpr, PDL: tl.constexpr):
    # data_ptrs, flag_ptrs: int64 [WORLD], each rank's slot area and flag area as addresses
    # in this process (its own, and its peers' mapped over NVLink).
    pdl.prologue(PDL)
    pid = tl.program_id(0)
    own_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    deadline = timeout_ns
    if TIMED:
        deadline += _now_ns(THREADS)
    dtype = x_ptr.dtype.element_ty
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    mine = tl.load(x_ptr + offs, mask=ok)
    # the slots are 16-byte aligned: let the copies be vector loads and stores
    own = tl.multiple_of(tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype)), 16)
    tl.store(own + slot_offset + offs, mine, mask=ok)
    # every thread's store before the flag that publishes them
    tl.debug_barrier()
    late = tl.full([], 0, tl.int32)
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int32))
            late += _swap_when(peer_flags + pid * WORLD + RANK, 0, 1, "release", deadline, TIMED,
                               THREADS)
    for q in tl.static_range(WORLD):
        if q != RANK:
            late += _swap_when(own_flags + pid * WORLD + q, 1, 0, "acquire", deadline, TIMED,
                               THREADS)
    if late > 0:
        _trap()
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == RANK:
            acc += mine.to(tl.float32)
        else:
            peer = tl.multiple_of(tl.load(data_ptrs + q).to(tl.pointer_type(dtype)), 16)
            # .cv: a peer's slot changes between calls; never serve it from a stale L1 line
            acc += tl.load(peer + slot_offset + offs, mask=ok, cache_modifier=".cv").to(
                tl.float32)
    tl.store(out_ptr + offs, acc.to(dtype), mask=ok)


@dataclass(frozen=True)
class PeerBuffers:
    """This rank's view of every rank's symmetric buffer: where each one's two slots and its
    flags are, as addresses valid in this process."""
    rank: int
    world: int
    data_ptrs: torch.Tensor  # int64 [world], on the device the kernel runs on
    flag_ptrs: torch.Tensor  # int64 [world]
    slot_bytes: int


def fits(peers: PeerBuffers, x: torch.Tensor) -> bool:
    """Whether x can go through the kernel: contiguous, not empty (an empty message would
    exchange no flags, and the slots would no longer alternate), within a slot."""
    return (x.is_contiguous() and 0 < x.numel() * x.element_size() <= peers.slot_bytes
            and triton.cdiv(x.numel(), BLOCK) <= MAX_PROGRAMS)


def one_shot_all_reduce(x: torch.Tensor, peers: PeerBuffers, slot: int,
                        timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    """The sum over the ranks of x (each rank calls it with its own x, at the same point of the
    same sequence of all-reduces), in a new tensor. slot: 0 or 1, alternating between
    consecutive calls (module docstring). timeout_s: how long a program waits for a peer
    before it traps (TIMEOUT_S)."""
    if not fits(peers, x):
        raise ValueError(f"one_shot_all_reduce: {x.numel()} elements of {x.dtype} do not fit "
                         f"a {peers.slot_bytes}-byte slot")
    if slot not in (0, 1):
        raise ValueError(f"one_shot_all_reduce: slot={slot} must be 0 or 1")
    out = torch.empty_like(x)
    n = x.numel()
    dependent = pdl.enabled(x, projection=False)
    _one_shot_all_reduce_kernel[(triton.cdiv(n, BLOCK),)](
        x, out, peers.data_ptrs, peers.flag_ptrs, n, slot * (peers.slot_bytes // x.element_size()),
        int(timeout_s * 1e9), RANK=peers.rank, WORLD=peers.world, BLOCK=BLOCK,
        TIMED=not _INTERPRET, THREADS=32 * NUM_WARPS, PDL=dependent,
        num_warps=NUM_WARPS, launch_pdl=dependent)
    return out

