"""Pinned host staging for host<->device copies that never stall the stream and never race.

A non-blocking H2D copy reads its pinned source when the stream gets to it, not when it is
enqueued. Rewriting the source before then corrupts the copy (the race of vLLM #24799). So
sources come from a ring of slots, and a slot is rewritten only after the event recorded behind
its last copy has fired. The same holds for D2H: the host reads a slot only after its event.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np
import torch


def host_tensor(values: "list | np.ndarray", dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list of Python numbers, through array.array: about 3x faster than
    torch.tensor(list) (a prefill of 64 x 128 tokens stages 25k ints: 1.0 against 3.4 ms).
    A numpy array of the dtype is taken as it is, without a copy."""
    code = {torch.int64: "q", torch.float32: "f"}.get(dtype)
    if code is None:
        raise ValueError(f"host_tensor takes int64 or float32, got dtype={dtype}")
    if isinstance(values, np.ndarray):
        return torch.from_numpy(values).to(dtype)
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


@dataclass
class _Slot:
    ints: torch.Tensor
    floats: torch.Tensor
    event: object | None = None  # torch.cuda.Event once used on CUDA


@dataclass
class RingStats:
    copies: int = 0
    waits: int = 0  # times a slot was still in flight when needed (should stay 0)


class H2DRing:
    def __init__(self, device: torch.device, num_slots: int = 4, capacity: int = 4096):
        self.device = device
        self.cuda = device.type == "cuda"
        self.num_slots = num_slots
        self.stats = RingStats()
        self._slots = [self._new_slot(capacity) for _ in range(num_slots)]
        self._next = 0
        self._staged: _Slot | None = None

    def _new_slot(self, capacity: int) -> _Slot:
        return _Slot(torch.empty(capacity, dtype=torch.int64, pin_memory=self.cuda),
                     torch.empty(capacity, dtype=torch.float32, pin_memory=self.cuda))

    def put(self, ints: "list[int] | np.ndarray",
            floats: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueues the copy of both lists to the device; returns the device tensors."""
        if not self.cuda:
            return (host_tensor(ints, torch.int64).to(self.device),
                    host_tensor(floats, torch.float32).to(self.device))
        hi, hf = self._stage(ints, floats)
        di = hi.to(self.device, non_blocking=True)
        df = hf.to(self.device, non_blocking=True)
        self._sent()
        return di, df

    def put_into(self, ints: "list[int] | np.ndarray", dest: torch.Tensor) -> None:
        """Enqueues the copy of `ints` into the start of the device tensor `dest` (a static
        buffer that a captured graph reads)."""
        if not self.cuda:
            dest[:len(ints)].copy_(host_tensor(ints, torch.int64))
            return
        hi, _ = self._stage(ints, [])
        dest[:len(ints)].copy_(hi, non_blocking=True)
        self._sent()

    def _stage(self, ints: "list[int] | np.ndarray",
               floats: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes both lists into the next slot once its last copy is done."""
        i = self._next
        self._next = (i + 1) % self.num_slots
        slot = self._slots[i]
        if slot.event is not None and not slot.event.query():
            self.stats.waits += 1
            slot.event.synchronize()
        need = max(len(ints), len(floats))
        if need > slot.ints.numel():
            slot = self._slots[i] = self._new_slot(max(need, 2 * slot.ints.numel()))
        hi = slot.ints[:len(ints)]
        hf = slot.floats[:len(floats)]
        hi.copy_(host_tensor(ints, torch.int64))
        hf.copy_(host_tensor(floats, torch.float32))
        self._staged = slot
        return hi, hf

    def _sent(self) -> None:
        """Records the event behind the copies just enqueued from the staged slot."""
        slot = self._staged
        if slot.event is None:
            slot.event = torch.cuda.Event()
        slot.event.record()
        self.stats.copies += 1

    def slot_buffers(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pinned buffers of slot i (tests inspect and rewrite them)."""
        return self._slots[i].ints, self._slots[i].floats


class ResultMailbox:
    """Where the GPU leaves each decode iteration's packed results (tokens and counts) for the
    host: a ring of slots in pinned host memory, written by the iteration's last kernel
    (kernels/publish_triton.py), so no D2H copy sits between two graph replays.

    The slot is picked on the device by a counter the kernel advances, since a replayed graph
    takes no host input. The host keeps a mirror of that counter: it adds one for every run of
    the kernel, eager or replayed, but not for a capture, which runs nothing. Whoever runs an
    iteration must call `ran()` once after it (ModelRunner.iterate and GraphSet.replay do, and
    ModelRunner's mixed steps, eager or replayed).

    A slot is rewritten R iterations later; the host reads each one an iteration after it was
    launched (reconcile is one step behind), so with R >= 3 it reads before the GPU rewrites.
    Visibility: the host reads a slot only after the event recorded behind its launch fired,
    and a kernel's stores to mapped host memory are visible once a later event completes."""

    def __init__(self, rows: int, width: int, device: torch.device, num_slots: int = 4):
        if num_slots < 3:
            raise ValueError(f"ResultMailbox needs num_slots >= 3, got num_slots={num_slots}")
        self.ring = torch.zeros(num_slots, rows, width, dtype=torch.int64, pin_memory=True)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.launched = 0  # the host's mirror of `counter`

    def publish(self, packed: torch.Tensor) -> None:
        """Enqueues the copy of packed ([n, width] on the device) into the next slot."""
        from ..kernels.publish_triton import publish

        publish(packed, self.ring, self.counter)

    def ran(self) -> None:
        if not torch.cuda.is_current_stream_capturing():
            self.launched += 1

    def next_slot(self) -> int:
        """The slot the next iteration writes."""
        return self.launched % self.ring.shape[0]
