"""A one-shot all-reduce of a decode step's partial sums over symmetric memory, in Triton: each
rank pushes its partial into its peers' memory with a flag inside every 8-byte store (the scheme
of NCCL's "LL", low-latency, protocol).

Each rank's o and down projections return a partial sum of a few kilobytes (a hidden state per
row) that the ranks must add up before the next norm. NCCL's all-reduce of such a message is all
protocol and no data, and it launches as an ordinary kernel, so the
kernel after it cannot start early. This kernel launches as a programmatic dependent
(kernels/pdl.py) and lets the next projection launch at once, so that projection fetches its
first weight tiles during the exchange; and its only traffic over NVLink is stores, which need no
answer:

- each program packs 4 bytes of its share of the partial with a 4-byte flag of 1 into one
  8-byte word, and stores the words into its box in every peer's area (mapped symmetric memory,
  parallel/symmetric.py; plain peer stores, no multicast);
- it then polls its own area (local memory) until every word from every peer carries the flag,
  adds the ranks' parts in rank order in fp32 and rounds once (every rank gets the same bits;
  at two ranks, NCCL's bits too), and zeroes the words it read, which makes them "not arrived"
  for the next use of the box.

An aligned store of whole 8-byte words reaches the peer whole (NCCL's LL protocol relies on the
same, with volatile stores: see the kernel for why not here), so a word seen with its flag holds
its data: no fence, no separate flag, no round trip. The price is twice the bytes on the link,
which decode messages afford; a pulling kernel (a compare-and-swap flag, then reads over NVLink:
two round trips) was slower (docs/architecture.md, "Tensor parallelism").

Slots: a rank may leave use k of the kernel while a peer still polls, so use k + 1 writes the
other slot. Before a rank can write slot s again (use k + 2) it must have received the peer's
words of use k + 1, which the peer sent only after it had finished use k, zeroing included (the
kernels of a stream complete in order): zeroed words are never overwritten early, and a word
seen with its flag is always this use's. The model alternates the slots by site (o: 0, down: 1),
in every forward and every graph alike, and a captured graph replays the kernel as it is
(parallel/symmetric.py refuses a slot used twice in a row). A message too large for the kernel
goes to NCCL, whose all-reduce waits for every rank, so the slot after it may be either.

Deadline: a wait that outlasts timeout_s traps, which fails the CUDA context, so the engine
raises at its next step instead of summing a stale box (as NCCL's watchdog ends a stuck
collective). The clock is read only once a poll has found a word missing, and one deadline
covers the waits for all peers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .rmsnorm import add_rms_norm_ref
from .tuning import DEFAULT, CollectiveTuning

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MAX_WORLD = 8  # ranks: at most 8 GPUs share one NVLink domain of a host
ARRIVED = 1 << 32  # the flag, in the high half of a word
_ARRIVED = tl.constexpr(ARRIVED)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}
# Widest row the fused norm takes (one program a row): 8192 bf16 elements, llama-70b's hidden.
MAX_ROW_WORDS = 4096
# A peer that has not pushed its words by then is dead or hung (module docstring). The first
# forward of a rank may wait for its peer's Triton compilation, hence the minute.
TIMEOUT_S = 60.0


def all_reduce_ref(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum the kernel computes: every rank's part in rank order, in fp32, rounded once."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    return total.to(parts[0].dtype)


def all_reduce_add_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor,
                                weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What all_reduce_add_rms_norm computes: (norm(sum + residual), sum + residual)."""
    return add_rms_norm_ref(all_reduce_ref(parts), residual, weight, eps)


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
def pair_words(lo, hi):
    """Two 16-bit tensors of one shape as int32 message words: lo in the low half."""
    lo_bits = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.int16, bitcast=True).to(tl.int32)
    return (hi_bits << 16) | lo_bits


@triton.jit
def _halves(w, DTYPE: tl.constexpr):
    """An int32 word of the message as fp32 values: two 16-bit elements (low, high), or one
    fp32 element (then high is 0)."""
    if DTYPE == tl.float32:
        lo = w.to(tl.float32, bitcast=True)
        hi = tl.zeros(w.shape, tl.float32)
    else:
        lo = w.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word(lo, hi, DTYPE: tl.constexpr):
    """_halves' inverse, rounding each fp32 sum to DTYPE once."""
    if DTYPE == tl.float32:
        word = lo.to(tl.int32, bitcast=True)
    else:
        word = pair_words(lo.to(DTYPE), hi.to(DTYPE))
    return word


@triton.jit
def push_words(words, offs, ok, area_ptrs, slot_words, source_words, RANK: tl.constexpr,
               WORLD: tl.constexpr):
    """Stores this rank's message words at offs (int32, any shape), each with the flag, into
    its box of the slot in every peer's area: the sending half of _exchange, which a
    projection's epilogue may do instead (Push)."""
    packed = (words.to(tl.int64) & 0xFFFFFFFF) | _ARRIVED
    for q in tl.static_range(WORLD):
        if q != RANK:
            # Boxes are 16-byte aligned (PeerAreas.box_words): two whole words to a store.
            # Plain (weak) stores: volatile ones (NCCL's LL protocol) made the all-reduce
            # several times slower, and an aligned 16-byte store never tore in any test (every
            # sum is checked bit for bit).
            peer = tl.multiple_of(tl.load(area_ptrs + q).to(tl.pointer_type(tl.int64)), 16)
            tl.store(peer + slot_words + RANK * source_words + offs, packed, mask=ok)


@triton.jit
def _exchange(words, area_ptrs, offs, ok, slot_words, source_words, timeout_ns,
              RANK: tl.constexpr, WORLD: tl.constexpr, DTYPE: tl.constexpr,
              BLOCK: tl.constexpr, TIMED: tl.constexpr, THREADS: tl.constexpr,
              PUSHED: tl.constexpr):
    """The sum over the ranks of the message words at offs (this rank's own: words), as fp32
    halves (_halves), not yet rounded. area_ptrs: int64 [WORLD], each rank's area as an
    address in this process (its own, and its peers' mapped over NVLink). A rank's area holds
    two slots of WORLD boxes of source_words 8-byte words, box q for rank q. PUSHED: the
    kernel that computed the words has already sent them (Push)."""
    if not PUSHED:
        push_words(words, offs, ok, area_ptrs, slot_words, source_words, RANK, WORLD)
    own = tl.multiple_of(tl.load(area_ptrs + RANK).to(tl.pointer_type(tl.int64)), 16)
    lo_sum = tl.zeros([BLOCK], dtype=tl.float32)
    hi_sum = tl.zeros([BLOCK], dtype=tl.float32)
    late = tl.full([], 0, tl.int32)
    deadline = tl.full([], 0, tl.int64)  # one for all peers, set at the first missing word
    for q in tl.static_range(WORLD):
        if q == RANK:
            w = words
        else:
            box = own + slot_words + q * source_words + offs
            got = tl.load(box, mask=ok, other=_ARRIVED, volatile=True)
            # reductions over the program: every thread sees the same answers, so all its
            # warps leave the loop together
            missing = tl.min((got >> 32).to(tl.int32), axis=0) == 0
            while missing & (late == 0):
                got = tl.load(box, mask=ok, other=_ARRIVED, volatile=True)
                missing = tl.min((got >> 32).to(tl.int32), axis=0) == 0
                if TIMED:
                    now = _now_ns(THREADS)
                    deadline = tl.where(deadline == 0, now + timeout_ns, deadline)
                    late = (missing & (now > deadline)).to(tl.int32)
            # read: the box is "not arrived" again for the slot's next use
            tl.store(box, tl.zeros([BLOCK], tl.int64), mask=ok)
            w = got.to(tl.int32)
        lo, hi = _halves(w, DTYPE)
        if q == 0:  # rank 0's part as it is, so -0.0 alone sums to -0.0, as NCCL's does
            lo_sum = lo
            hi_sum = hi
        else:
            lo_sum += lo
            hi_sum += hi
    if late > 0:
        _trap()
    return lo_sum, hi_sum


@triton.jit
def _all_reduce_kernel(x_ptr, out_ptr, area_ptrs, n_words, slot_words, source_words,
                       timeout_ns, RANK: tl.constexpr, WORLD: tl.constexpr,
                       DTYPE: tl.constexpr, BLOCK: tl.constexpr, TIMED: tl.constexpr,
                       THREADS: tl.constexpr, PDL: tl.constexpr, PUSHED: tl.constexpr):
    # x_ptr, out_ptr: the message as int32 words; program p sends and sums words
    # [p * BLOCK, (p + 1) * BLOCK)
    pdl.prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_words
    words = tl.load(x_ptr + offs, mask=ok, other=0)
    lo_sum, hi_sum = _exchange(words, area_ptrs, offs, ok, slot_words, source_words,
                               timeout_ns, RANK, WORLD, DTYPE, BLOCK, TIMED, THREADS, PUSHED)
    tl.store(out_ptr + offs, _word(lo_sum, hi_sum, DTYPE), mask=ok)


@triton.jit
def _all_reduce_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, normed_ptr, summed_ptr, area_ptrs,
                                    row_words, d, eps, slot_words, source_words, timeout_ns,
                                    RANK: tl.constexpr, WORLD: tl.constexpr,
                                    DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                                    TIMED: tl.constexpr, THREADS: tl.constexpr,
                                    PDL: tl.constexpr, PUSHED: tl.constexpr):
    # Program r: row r of the message (row_words int32 words, d elements), summed over the
    # ranks as _all_reduce_kernel sums it, then what kernels/norm_rope_triton.add_rms_norm
    # makes of that sum and the residual row, with its rounding points: the sum rounded to
    # the dtype, the residual added in fp32 and rounded, normalised in fp32 and rounded, times
    # the norm weight rounded once. All ranks compute the same bits from the same inputs.
    pdl.prologue(PDL)
    cols = tl.arange(0, BLOCK)
    ok = cols < row_words
    offs = tl.program_id(0).to(tl.int64) * row_words + cols
    words = tl.load(x_ptr + offs, mask=ok, other=0)
    # the residual and the norm weight are loaded before the wait for the peers, so that their
    # latency hides behind it
    residual = tl.load(res_ptr + offs, mask=ok, other=0)
    norm_weight = tl.load(w_ptr + cols, mask=ok, other=0)
    lo_sum, hi_sum = _exchange(words, area_ptrs, offs, ok, slot_words, source_words,
                               timeout_ns, RANK, WORLD, DTYPE, BLOCK, TIMED, THREADS, PUSHED)
    r_lo, r_hi = _halves(residual, DTYPE)
    # masked words are 0 in every operand, so they add nothing to the sum of squares
    s_lo = (lo_sum.to(DTYPE).to(tl.float32) + r_lo).to(DTYPE).to(tl.float32)
    s_hi = (hi_sum.to(DTYPE).to(tl.float32) + r_hi).to(DTYPE).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(s_lo * s_lo + s_hi * s_hi, axis=0) / d + eps)
    w_lo, w_hi = _halves(norm_weight, DTYPE)
    y_lo = (s_lo * rstd).to(DTYPE).to(tl.float32)
    y_hi = (s_hi * rstd).to(DTYPE).to(tl.float32)
    tl.store(summed_ptr + offs, _word(s_lo, s_hi, DTYPE), mask=ok)
    tl.store(normed_ptr + offs, _word(y_lo * w_lo, y_hi * w_hi, DTYPE), mask=ok)


@dataclass(frozen=True)
class PeerAreas:
    """This rank's view of every rank's area: where each one starts, as addresses valid in
    this process, and how many message words a box holds (box_words' multiple)."""
    rank: int
    world: int
    area_ptrs: torch.Tensor  # int64 [world], on the device the kernel runs on
    max_words: int

    @staticmethod
    def box_words(max_bytes: int) -> int:
        """Message words a box of at most max_bytes of message holds: a multiple of 64, so
        every box of an area starts 512-byte aligned, whatever the number of ranks."""
        return max_bytes // 4 // 64 * 64

    @staticmethod
    def area_bytes(world: int, max_words: int) -> int:
        """Bytes of one rank's area: two slots of world boxes of 8-byte words."""
        return 2 * world * max_words * 8


@dataclass(frozen=True)
class Push:
    """Where a projection sends its output as this rank's message of an all-reduce, from its
    epilogue (push_words), instead of the all-reduce kernel sending it after the projection
    has finished: the peers receive each tile as soon as it is computed, and the all-reduce
    that follows (called with pushed=True) only waits and sums. areas, slot: as that
    all-reduce's. The slot protocol (module docstring) holds as before: a projection's
    epilogue runs after its PDL wait, so everything before it on the stream, the previous
    all-reduce's zeroing included, has finished (every kernel launched as a programmatic
    dependent passes its wait before it finishes, kernels/pdl.py)."""
    areas: PeerAreas
    slot: int

    @property
    def slot_words(self) -> int:
        return self.slot * self.areas.world * self.areas.max_words

    def fits(self, rows: int, width: int, dtype: torch.dtype) -> bool:
        """Whether a dense [rows, width] output can be pushed as a message: 16-bit elements
        (two a word), an even width (no word straddles two rows), within a box."""
        return (dtype in (torch.bfloat16, torch.float16) and width % 2 == 0
                and 0 < rows * width // 2 <= self.areas.max_words)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bytes as int32 words, the unit the kernels move."""
    return t.view(-1).view(torch.int32)


def fits(areas: PeerAreas, x: torch.Tensor) -> bool:
    """Whether x can go through the kernel: a dtype it sums, contiguous, whole and aligned
    4-byte words, not empty (an empty message would send no words, and the slots would no
    longer alternate), within a box."""
    nbytes = x.numel() * x.element_size()
    return (x.dtype in _TL_DTYPES and x.is_contiguous() and nbytes % 4 == 0
            and x.data_ptr() % 4 == 0 and 0 < nbytes // 4 <= areas.max_words)


def all_reduce(x: torch.Tensor, areas: PeerAreas, slot: int,
               timeout_s: float = TIMEOUT_S, pushed: bool = False,
               t: CollectiveTuning = DEFAULT.collective) -> torch.Tensor:
    """The sum over the ranks of x (each rank calls it with its own x, at the same point of the
    same sequence of all-reduces), in a new tensor. slot: 0 or 1, alternating between
    consecutive calls (module docstring). timeout_s: how long a program waits for a peer
    before it traps. pushed: the kernel that computed x has sent it already (Push); every
    rank must say the same. t: the launch config (all_reduce_block words a program, in
    all_reduce_warps warps)."""
    if not fits(areas, x):
        raise ValueError(f"all_reduce: {x.numel()} elements of {x.dtype} do not fit "
                         f"{areas.max_words} 4-byte words")
    if slot not in (0, 1):
        raise ValueError(f"all_reduce: slot={slot} must be 0 or 1")
    out = torch.empty_like(x)
    n_words = x.numel() * x.element_size() // 4
    source_words = areas.max_words
    dependent = pdl.enabled(x)
    block, warps = t.all_reduce_block, t.all_reduce_warps
    _all_reduce_kernel[(triton.cdiv(n_words, block),)](
        _words(x), _words(out), areas.area_ptrs, n_words,
        slot * areas.world * source_words, source_words, int(timeout_s * 1e9),
        RANK=areas.rank, WORLD=areas.world, DTYPE=_TL_DTYPES[x.dtype], BLOCK=block,
        TIMED=not _INTERPRET, THREADS=32 * warps, PDL=dependent, PUSHED=pushed,
        num_warps=warps, launch_pdl=dependent)
    return out


def fits_norm(areas: PeerAreas, x: torch.Tensor, residual: torch.Tensor,
              weight: torch.Tensor) -> bool:
    """Whether all_reduce_add_rms_norm takes these: x fits (fits) as [rows, d] rows of whole
    words, at most MAX_ROW_WORDS each; residual and weight dense, of x's dtype and shape."""
    if not (x.dim() == 2 and fits(areas, x)):
        return False
    row_bytes = x.shape[1] * x.element_size()
    return (row_bytes % 4 == 0 and row_bytes // 4 <= MAX_ROW_WORDS
            and residual.shape == x.shape and weight.shape == x.shape[1:]
            and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                    and t.data_ptr() % 4 == 0 for t in (residual, weight)))


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, areas: PeerAreas, slot: int,
                            timeout_s: float = TIMEOUT_S, pushed: bool = False,
                            t: CollectiveTuning = DEFAULT.collective
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """all_reduce(x) followed by the residual add and RMSNorm that come next in the model, in
    one kernel: (norm(sum + residual), sum + residual), with kernels/rmsnorm.add_rms_norm_ref's
    rounding points (the sum bit for bit, the norm within one rounding: the squares are summed
    in another order). The sum itself is not stored. Saves the norm's launch and its round trip
    through memory, and lets the projection after it skip a norm prologue that each of its
    programs would repeat. Arguments as all_reduce's; x: [rows, d]."""
    if not fits_norm(areas, x, residual, weight):
        raise ValueError(f"all_reduce_add_rms_norm: x {tuple(x.shape)} {x.dtype} (residual "
                         f"{tuple(residual.shape)} {residual.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}) is not a message the kernel "
                         f"takes: rows of whole 4-byte words within a box, one dtype")
    if slot not in (0, 1):
        raise ValueError(f"all_reduce_add_rms_norm: slot={slot} must be 0 or 1")
    rows, d = x.shape
    row_words = d * x.element_size() // 4
    block = triton.next_power_of_2(row_words)
    warps = max(4, min(16, block // (32 * t.norm_words_per_thread)))
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    dependent = pdl.enabled(x)
    _all_reduce_add_rms_norm_kernel[(rows,)](
        _words(x), _words(residual), _words(weight), _words(normed), _words(summed),
        areas.area_ptrs, row_words, d, float(eps), slot * areas.world * areas.max_words,
        areas.max_words, int(timeout_s * 1e9), RANK=areas.rank, WORLD=areas.world,
        DTYPE=_TL_DTYPES[x.dtype], BLOCK=block, TIMED=not _INTERPRET, THREADS=32 * warps,
        PDL=dependent, PUSHED=pushed, num_warps=warps, launch_pdl=dependent)
    return normed, summed
