"""PenaltyState: what penalties, logit bias and min_p read on the device, per penalty slot.

A row whose request uses any of them holds a slot for as long as it is in the batch; its row of
DecodeState holds the slot's number (`DecodeState.penalty_slots`, 0 for none), so a compaction
moves one int per row and never the [S, V] buffers. A slot is filled from the host when its row
joins the batch (`pack_init` / `apply_init`, beside the step's delta): the prompt's tokens as
presence, the counts of the tokens generated so far (a resumed or recomputed request has some),
the bias pairs and the penalties. From then on the steps count each token they sample into it
on the device (kernels/penalties.py, count_tokens), so under async scheduling the counts are
never behind the host's view, nor waiting on it.

A slot freed when its row leaves may be handed to a row joining in the same delta: the steps
launched before still write the old counts, but they run before the new slot's fill on the one
stream, and no later step reads the old row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..plan import RowPenalties, StepDelta
from ..sampling_params import MAX_LOGIT_BIAS

_FLOATS = 4  # presence, frequency, repetition, log(min_p)


@dataclass
class PenaltyInit:
    """The slots a delta fills, packed for one H2D copy (`pack_init`)."""

    ints: list[int]
    floats: list[float]
    num_slots: int
    num_prompt: int  # (slot, token) pairs of prompt presence
    num_output: int  # (slot, token) pairs of generated tokens, one per token


class PenaltyState:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        s = max_rows + 1  # slot 0 is nobody's: its rows are left as they are
        self.counts = torch.zeros(s, vocab_size, device=device, dtype=torch.int32)
        self.prompt_mask = torch.zeros(s, vocab_size, device=device, dtype=torch.bool)
        self.bias_ids = torch.full((s, MAX_LOGIT_BIAS), -1, device=device, dtype=torch.int32)
        self.bias_vals = torch.zeros(s, MAX_LOGIT_BIAS, device=device, dtype=torch.float32)
        self._floats = torch.zeros(_FLOATS, s, device=device, dtype=torch.float32)
        self.presence, self.frequency, self.repetition, self.log_min_p = self._floats
        self.repetition.fill_(1.0)
        self.log_min_p.fill_(-math.inf)
        # host mirror: each row's slot, and the slots free to take
        self._row_slot = [0] * (max_rows + 1)
        self._free = list(range(s - 1, 0, -1))

    def assign(self, delta: StepDelta) -> list[int]:
        """Moves the host's row -> slot map as the delta moves the rows, frees the slots of
        rows that left and gives each joining row that uses penalties a slot. Returns the slot
        of each new row (0: none), in the order of delta.new_rows."""
        if delta.row_map is not None:
            old = self._row_slot
            kept = [old[i] for i in delta.row_map]
            gone = set(old) - set(kept) - {0}
            self._free += sorted(gone, reverse=True)
            self._row_slot = kept + [0] * (len(old) - len(kept))
        slots = []
        for r in delta.new_rows:
            slot = self._free.pop() if r.penalties is not None else 0
            self._row_slot[r.row] = slot
            slots.append(slot)
        return slots

    def apply_init(self, init: PenaltyInit, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Fills the slots of `init` from its packed lists, already on the device."""
        n, p, o, w = init.num_slots, init.num_prompt, init.num_output, MAX_LOGIT_BIAS
        slots = ints[:n]
        at = n
        self.bias_ids[slots] = ints[at:at + n * w].view(n, w).to(torch.int32)
        at += n * w
        self.counts[slots] = 0
        self.prompt_mask[slots] = False
        self.prompt_mask[ints[at:at + p], ints[at + p:at + 2 * p]] = True
        at += 2 * p
        ones = torch.ones(o, device=ints.device, dtype=torch.int32)
        self.counts.index_put_((ints[at:at + o], ints[at + o:at + 2 * o]), ones, accumulate=True)
        self._floats[:, slots] = floats[:_FLOATS * n].view(_FLOATS, n)
        self.bias_vals[slots] = floats[_FLOATS * n:].view(n, w)


def pack_init(delta: StepDelta, slots: list[int]) -> PenaltyInit | None:
    """The fill of every slot `assign` gave out for this delta; None when it gave none."""
    rows = [(s, r.penalties) for s, r in zip(slots, delta.new_rows) if s]
    if not rows:
        return None
    ints = [s for s, _ in rows]
    vals: list[float] = []
    for _, pen in rows:
        ids = list(pen.logit_bias)
        pad = MAX_LOGIT_BIAS - len(ids)
        ints += ids + [-1] * pad
        vals += list(pen.logit_bias.values()) + [0.0] * pad
    prompt = [(s, sorted(set(pen.prompt))) for s, pen in rows]
    for part in (prompt, [(s, list(pen.output)) for s, pen in rows]):
        ints += [s for s, toks in part for _ in toks]
        ints += [t for _, toks in part for t in toks]
    floats = [pen.presence for _, pen in rows] + [pen.frequency for _, pen in rows]
    floats += [pen.repetition for _, pen in rows]
    floats += [math.log(pen.min_p) if pen.min_p > 0 else -math.inf for _, pen in rows]
    return PenaltyInit(ints, floats + vals, len(rows),
                       sum(len(t) for _, t in prompt), sum(len(pen.output) for _, pen in rows))
