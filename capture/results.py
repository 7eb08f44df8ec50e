"""ResultRing: where each step's results reach the host. One slot of pinned host memory per
launched step, num_slots of them reused in turn.

A slot holds the decode rows' results (W tokens each, and logprobs) and, apart, the prompt chunks'
samples (one each), so that every copy into it lands in contiguous memory: a D2H copy into a
strided destination goes through a pageable temporary, which blocks the host until the stream
reaches it. The decode rows' tokens and counts are stored there by the GPU itself: the last
kernel of the iteration (kernels/publish_triton.py) writes them into the slot a device counter
points at, so no D2H copy sits between two graph replays and a replayed graph needs no host
input. Everything else a step returns (prompt chunks' samples, logprobs) is copied after it.

Every launch takes the next slot (`take`) and every launch publishes exactly once, so the device
counter and the host's count of launches agree; the eager warm-ups before graph capture publish
too, and `reset` puts both back to zero after them. A slot is rewritten num_slots launches later;
the host reads each one a launch after it was taken, so with num_slots >= 3 it reads it before
anything rewrites it. Visibility: the host reads a slot only after the event recorded behind its
step fired, and a kernel's stores to mapped host memory are visible once a later event completed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ResultRows:
    """Some rows of a step's results, numpy views of its slot (valid until the slot is taken
    again, num_slots launches later)."""

    tokens: np.ndarray  # [n, W]
    counts: np.ndarray | None  # [n] tokens each row emitted (decode rows; None for chunks)
    logprob: np.ndarray  # [n, W] the chosen tokens' logprobs (when the step computed them)
    top_logprobs: np.ndarray  # [n, W, N]
    top_ids: np.ndarray  # [n, W, N]


@dataclass
class StepResults:
    decode: ResultRows  # one per decode row, in row order
    prefill: ResultRows  # one per prompt chunk, in launch order: its one sample, W = 1
    with_logprobs: bool
    # prompt logprobs (chosen [P], top values [P, N], top ids [P, N]) of the chunks that asked,
    # in launch order (graphexec/plan.py, PrefillChunk.logprob_targets)
    prompt: tuple | None = None


@dataclass
class ResultSlot:
    """One step's pinned results: views of the ring's buffers, as tensors (what the device
    copies into) and as numpy arrays (what the host reads)."""

    decode: tuple[torch.Tensor, ...]  # tokens [rows, W], logprob [rows, W], top_logprobs and
    # top_ids [rows, W, N]; the tokens are a view of the packed buffer publish stores
    prefill: tuple[torch.Tensor, ...]  # tokens, logprob [rows]; top_logprobs, top_ids [rows, N]
    arrays: tuple[np.ndarray, ...]  # packed (tokens, count), logprob, top_logprobs, top_ids
    prefill_arrays: tuple[np.ndarray, ...]  # tokens, logprob, top_logprobs, top_ids
    event: torch.cuda.Event | None = None  # recorded behind the step's last copy (CUDA)


class ResultRing:
    def __init__(self, rows: int, width: int, num_logprobs: int, device: torch.device,
                 num_slots: int = 4):
        if num_slots < 3:
            raise ValueError(f"ResultRing needs num_slots >= 3, got num_slots={num_slots}")
        self.cuda = device.type == "cuda"
        self.num_slots = num_slots

        def pinned(*shape, dtype=torch.int64):
            return torch.zeros(num_slots, rows, *shape, dtype=dtype, pin_memory=self.cuda)

        w, n = width, num_logprobs
        # tokens, then the count: DecodeState.out_packed's layout, which publish stores whole
        self.packed = pinned(w + 1)
        dec = (self.packed, pinned(w, dtype=torch.float32), pinned(w, n, dtype=torch.float32),
               pinned(w, n))
        pre = (pinned(), pinned(dtype=torch.float32), pinned(n, dtype=torch.float32), pinned(n))
        self.slots = [ResultSlot((dec[0][i, :, :w], *(b[i] for b in dec[1:])),
                                 tuple(b[i] for b in pre),
                                 arrays=tuple(b[i].numpy() for b in dec),
                                 prefill_arrays=tuple(b[i].numpy() for b in pre))
                      for i in range(num_slots)]
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)  # the slot to publish
        if self.cuda:
            from ..kernels.publish_triton import publish
        else:  # the reference: the same stores, by torch ops
            from ..kernels.publish import publish_ref as publish
        self._publish = publish
        self.launched = 0  # slots taken: the host's count of the device counter
        self.waits = 0  # times a slot's last step was still running when taken again (stays 0)

    def publish(self, packed: torch.Tensor) -> None:
        """Enqueues the store of the decode rows' packed results ([n, W + 1] on the device) into
        the slot the device counter points at, and advances the counter."""
        self._publish(packed, self.packed, self.counter)

    def take(self) -> int:
        """The slot of the step being launched: the one place a slot changes hands."""
        i = self.launched % self.num_slots
        self.launched += 1
        event = self.slots[i].event
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()
        return i

    def reset(self) -> None:
        """Back to slot 0 on both sides (after warm-up runs that published outside a launch)."""
        self.counter.zero_()
        self.launched = 0

    def record(self, i: int) -> None:
        """Marks the end of slot i's step on the stream: the host reads the slot after it."""
        if self.cuda:
            slot = self.slots[i]
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record()

    def read(self, i: int, num_decode: int, num_prefill: int,
             with_logprobs: bool) -> StepResults:
        """Slot i's results as numpy views; the caller has waited for its event."""
        slot = self.slots[i]
        packed, lp, top_lp, top_ids = (a[:num_decode] for a in slot.arrays)
        decode = ResultRows(packed[:, :-1], packed[:, -1], lp, top_lp, top_ids)
        # a chunk's one sample as a row of width 1, read as a decode row's tokens are
        tok, lp, top_lp, top_ids = (a[:num_prefill, None] for a in slot.prefill_arrays)
        prefill = ResultRows(tok, None, lp, top_lp, top_ids)
        return StepResults(decode, prefill, with_logprobs)
