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

import numpy as np
import torch

from ..kernels.penalties import IN_PROMPT, LISTED
from ..plan import RowPenalties, StepDelta
from ..sampling_params import MAX_LOGIT_BIAS

_FLOATS = 4  # presence, frequency, repetition, log(min_p)


@dataclass
class PenaltyInit:
    """The slots a delta fills, packed for one H2D copy (`pack_init`): int64 and float32
    arrays, built with numpy because a batch of 64 prompts of 128 tokens packs 30k entries
    and Python lists of them cost milliseconds of the host's step."""

    ints: np.ndarray
    floats: np.ndarray
    num_slots: int
    num_bias: int  # (slot, index, token) entries of the slots' logit bias, values in floats
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
        """Fills the slots of `init` from its packed arrays, already on the device."""
        n, nb, m, o = init.num_slots, init.num_bias, init.num_listed, init.num_output
        slots = ints[:n]
        self.bias_ids[slots] = -1
        bs, bj, bt = ints[n:n + 3 * nb].view(3, nb)
        self.bias_ids[bs, bj] = bt.to(torch.int32)
        self.bias_vals[bs, bj] = floats[_FLOATS * n:]
        at = n + 3 * nb
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


def _listed(rows: list[tuple[int, RowPenalties]]) -> tuple[np.ndarray, ...]:
    """The slots' first lists of seen tokens, as (slot, position, token, flags) arrays: each
    prompt's distinct tokens, then the generated ones outside the prompt in order of first
    appearance, as count_tokens would have listed them. One np.unique over every prompt (row
    index in the high 32 bits) rather than one per row."""
    keys = np.unique(np.concatenate(
        [np.asarray(pen.prompt, dtype=np.int64) + (i << 32) for i, (_, pen) in enumerate(rows)]))
    row, tok = keys >> 32, keys & 0xFFFFFFFF
    flags = np.full(len(keys), IN_PROMPT | LISTED, dtype=np.int64)
    resumed = []  # a resumed or recomputed request: its generated tokens after its prompt's
    for i, (_, pen) in enumerate(rows):
        if pen.output:
            prompt = set(pen.prompt)
            resumed += [(i, t) for t in dict.fromkeys(pen.output) if t not in prompt]
    if resumed:
        extra = np.array(resumed, dtype=np.int64).reshape(-1, 2)
        row, tok = np.concatenate([row, extra[:, 0]]), np.concatenate([tok, extra[:, 1]])
        flags = np.concatenate([flags, np.full(len(extra), LISTED, dtype=np.int64)])
        order = np.argsort(row, kind="stable")
        row, tok, flags = row[order], tok[order], flags[order]
    lens = np.bincount(row, minlength=len(rows))
    position = np.arange(len(row)) - np.repeat(np.cumsum(lens) - lens, lens)
    slots = np.array([s for s, _ in rows], dtype=np.int64)
    return lens, slots[row], position, tok, flags


def pack_init(delta: StepDelta, slots: list[int]) -> PenaltyInit | None:
    """The fill of every slot `assign` gave out for this delta; None when it gave none."""
    rows = [(s, r.penalties) for s, r in zip(slots, delta.new_rows) if s]
    if not rows:
        return None
    ids = np.array([s for s, _ in rows], dtype=np.int64)
    bias = [(s, j, t, v) for s, pen in rows for j, (t, v) in enumerate(pen.logit_bias.items())]
    lens, *listed = _listed(rows)
    output = [(s, t) for s, pen in rows for t in pen.output]
    ints = np.concatenate([ids, np.array([e[:3] for e in bias], dtype=np.int64).T.reshape(-1),
                           lens, *listed, np.array(output, dtype=np.int64).T.reshape(-1)])
    floats = np.array([pen.presence for _, pen in rows] + [pen.frequency for _, pen in rows]
                      + [pen.repetition for _, pen in rows]
                      + [math.log(pen.min_p) if pen.min_p > 0 else -math.inf for _, pen in rows]
                      + [e[3] for e in bias], dtype=np.float32)
    return PenaltyInit(ints, floats, len(rows), len(bias), int(lens.sum()), len(output))
