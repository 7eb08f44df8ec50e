"""PenaltyState: what penalties, logit bias and min_p read on the device, per penalty slot.

A row whose request uses any of them holds a slot for as long as it is in the batch; its row of
DecodeState holds the slot's number (`DecodeState.penalty_slots`, 0 for none), so a compaction
moves one int per row and never the [S, V] buffers. A slot is filled from the host when its row
joins the batch (`pack_init` / `apply_init`, beside the step's delta): the prompt's tokens as
presence, the counts of the tokens generated so far (a resumed or recomputed request has some),
the list of the distinct tokens among both, the bias pairs and the penalties. From then on the
steps count each token they sample into it on the device (kernels/penalties.py, count_tokens),
listing the new ones, so under async scheduling the counts are never behind the host's view,
nor waiting on it.

A slot freed when its row leaves may be handed to a row joining in the same delta: the steps
launched before still write the old counts, but they run before the new slot's fill on the one
stream, and no later step reads the old row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.penalties import IN_PROMPT, LISTED
from ..plan import RowPenalties, StepDelta
from ..sampling_params import MAX_LOGIT_BIAS

_FLOATS = 4  # presence, frequency, repetition, log(min_p)


@dataclass
class PenaltyInit:
    """The slots a delta fills, packed for one H2D copy (`pack_init`)."""

    ints: list[int]
    floats: list[float]
    num_slots: int
    num_listed: int  # (slot, position, token, flags) entries of the slots' lists
    num_output: int  # (slot, token) pairs of generated tokens, one per token


class PenaltyState:
    """Per slot: counts int32 [S, V] of the generated tokens; flags uint8 [S, V] (IN_PROMPT,
    LISTED: kernels/penalties.py); seen_ids int32 [S, V], whose first num_seen[slot] entries
    list the distinct tokens of the prompt and the output, the only ones the penalties kernel
    visits. The list has V entries, not prompt + max_tokens: a token is listed once, ever
    (LISTED stays set when a speculative step takes its count back to 0), so a slot lists at
    most V tokens and can never overflow, whatever the lengths. In all 9 bytes per slot and
    vocabulary entry."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        s = max_rows + 1  # slot 0 is nobody's: its rows are left as they are
        self.counts = torch.zeros(s, vocab_size, device=device, dtype=torch.int32)
        self.flags = torch.zeros(s, vocab_size, device=device, dtype=torch.uint8)
        self.seen_ids = torch.zeros(s, vocab_size, device=device, dtype=torch.int32)
        self.num_seen = torch.zeros(s, device=device, dtype=torch.int32)
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
        n, m, o, w = init.num_slots, init.num_listed, init.num_output, MAX_LOGIT_BIAS
        slots = ints[:n]
        at = n
        self.bias_ids[slots] = ints[at:at + n * w].view(n, w).to(torch.int32)
        at += n * w
        self.num_seen[slots] = ints[at:at + n].to(torch.int32)
        at += n
        self.counts[slots] = 0
        self.flags[slots] = 0
        # entries past num_seen keep the slot's last owner's tokens: nothing reads them
        ls, pos, tok, bits = ints[at:at + 4 * m].view(4, m)
        self.seen_ids[ls, pos] = tok.to(torch.int32)
        self.flags[ls, tok] = bits.to(torch.uint8)
        at += 4 * m
        ones = torch.ones(o, device=ints.device, dtype=torch.int32)
        self.counts.index_put_((ints[at:at + o], ints[at + o:at + 2 * o]), ones, accumulate=True)
        self._floats[:, slots] = floats[:_FLOATS * n].view(_FLOATS, n)
        self.bias_vals[slots] = floats[_FLOATS * n:].view(n, w)


def _seen(pen: RowPenalties) -> list[tuple[int, int]]:
    """A slot's first list of seen tokens, with their flags: the prompt's distinct tokens, then
    the generated ones outside the prompt, as count_tokens would have listed them."""
    prompt = set(pen.prompt)
    out = [t for t in dict.fromkeys(pen.output) if t not in prompt]
    return [(t, IN_PROMPT | LISTED) for t in sorted(prompt)] + [(t, LISTED) for t in out]


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
    seen = [_seen(pen) for _, pen in rows]
    ints += [len(x) for x in seen]
    listed = [(s, j, t, f) for (s, _), x in zip(rows, seen) for j, (t, f) in enumerate(x)]
    for k in range(4):  # slots, positions, tokens, flags
        ints += [e[k] for e in listed]
    output = [(s, t) for s, pen in rows for t in pen.output]
    ints += [s for s, _ in output] + [t for _, t in output]
    floats = [pen.presence for _, pen in rows] + [pen.frequency for _, pen in rows]
    floats += [pen.repetition for _, pen in rows]
    floats += [math.log(pen.min_p) if pen.min_p > 0 else -math.inf for _, pen in rows]
    return PenaltyInit(ints, floats + vals, len(rows), len(listed), len(output))
