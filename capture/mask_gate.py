"""Grammar masks that reach a step after it was launched.

A grammar row's mask at step n + 1 follows its token of step n, which the host reads only once
step n is done. Reading step n before launching n + 1 leaves the GPU idle while the host
reconciles, plans, fills the masks and launches. Instead, on one CUDA device without drafts, a
step that replays a captured graph (decode or mixed) is launched at once, armed with a ticket.
Its forward runs while the host reads step n, advances the matchers and fills the masks into
pinned memory here; then the host raises a flag to the ticket. Before masking, the step waits
on the device for the flag and copies the rows in (kernels/mask_gate_triton.py).

Only graphs wait. An eager step would have the host launch kernels between the wait and the
release, and a kernel's first launch loads its module, which waits for the device: a deadlock
(found on the H100 with eager mixed steps). Eager grammar steps read the step in flight and get
their masks before launch instead.

One set of pinned buffers is enough. The host fills the masks of step n + 1 only after it has
read step n, so step n's copy is done, and step n + 1's copy waits for the flag. The flag holds
the last ticket released and tickets only grow, so a flag raised for an earlier step never lets
a later one through.
"""
from __future__ import annotations

import threading

import torch

from ..kernels.mask_gate_triton import await_masks

_OPEN = 1 << 62  # a ticket no step reaches: lets every waiting step through


class MaskGate:
    def __init__(self, rows: torch.Tensor, num_rows: torch.Tensor, mask_words: int):
        """rows: DecodeState.grammar_rows, the device buffer the masking kernels read;
        num_rows: DecodeState.num_rows, how many of them a step's masks cover (0 here);
        mask_words: int32 words of one row's mask (vocabulary size / 32, rounded up)."""
        self.rows, self.num_rows = rows, num_rows
        # Masks apart from the flags, so that xgrammar fills them where they are read from:
        # copying 64 rows' 1 MB into the rows' layout took 0.24 ms a step on a 2-core CPU.
        self.masks = torch.zeros(rows.shape[0], mask_words, dtype=torch.int32, pin_memory=True)
        self.flags = torch.zeros(rows.shape[0], dtype=torch.int64, pin_memory=True)
        self.host_masks, self.host_flags = self.masks.numpy(), self.flags.numpy()
        # the last ticket released, which the device polls
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._flag = self.flag.numpy()
        # tickets the device has gone through: each waiting step's is the next one
        self.passed = torch.zeros(1, dtype=torch.int64, device=rows.device)
        self.issued = 0
        self.released = 0
        # Compiled and loaded now, not first under a capture: with no rows in use it copies
        # nothing and waits for nothing.
        await_masks(self.flag, self.passed, num_rows, self.masks, self.flags, rows)
        self.passed.zero_()
        # A lock's acquire and release are full memory barriers: the mask rows become visible
        # before the flag on hosts that may reorder stores (aarch64; x86 keeps their order).
        self._barrier = threading.Lock()

    def pull(self) -> None:
        """Captures the wait and the copy into the device rows; eager steps skip it (the
        module docstring says why) and get their masks before launch."""
        if torch.cuda.is_current_stream_capturing():
            await_masks(self.flag, self.passed, self.num_rows, self.masks, self.flags,
                        self.rows)

    def arm(self) -> int:
        """The ticket of a step about to replay a graph that waits for its masks."""
        self.issued += 1
        return self.issued

    def pending(self, ticket: int) -> bool:
        return ticket > self.released

    def release(self, ticket: int) -> None:
        """The step holding `ticket` may read host_masks and host_flags (filled by the caller)
        now."""
        if ticket != self.released + 1:
            raise RuntimeError(f"mask ticket {ticket} released out of order "
                               f"(last {self.released})")
        self.released = ticket
        with self._barrier:
            pass
        self._flag[0] = ticket

    def release_through(self, ticket: int) -> None:
        """Lets every step up to `ticket` go on with whatever the rows hold: after an error
        mid-step, so that no step is left waiting until its deadline traps."""
        self.released = max(self.released, ticket)
        self._flag[0] = self.released

    def open(self) -> None:
        """Lets every armed step through (closing an engine with steps still waiting)."""
        self._flag[0] = _OPEN
