"""Grammar masks, penalties, logit bias and min_p at the positions a speculative step verifies.

The verify scores K + 1 positions per row at once: position j follows the row's tokens so far
and the drafts d_1..d_j. The controls must give each position the distribution the plain
sampler would give it after those tokens, so that greedy output with speculation equals greedy
output without it, token for token:

- Grammar rows take no drafts. The host knows a row's matcher state before the step's first
  token only (the drafts are drawn on the device), so position 0 gets the mask the host wrote
  and the row's drafts are rejected: one token a step, never one the grammar refuses.
- Penalties read the counts of the tokens generated so far. Position j counts the drafts
  before it too, since it is emitted only if they were accepted: each draft is counted into
  the row's slot before the next position is penalised. Once the step knows what it emits,
  `recount` takes the drafts that were not emitted back out and counts the last token.
- Logit bias and min_p read no counts: one launch over every position.

A grammar row that joins the batch in this step also samples its first token in the prefill,
from the mask at the grammar's start; the mask after that token is not known yet, so its
verify emits nothing this step (`MASK_HOLD`, graphexec/structured.py) and the state is left
where the prefill put it.
"""
from __future__ import annotations

import torch

from ..model.llama import LlamaModel
from ..structured import MASK_HOLD
from .state import DecodeState


def repeat_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """Each row n times in a row (repeat_interleave over dim 0 in one copy launch: torch's
    repeat_interleave on CUDA runs a cumsum and a gather). Always a dense copy: a reshape of
    the expanded view would stay a stride-0 view for one row, which kernels reading [rows]
    vectors as dense would misread."""
    rows = x[:, None].expand(x.shape[0], n, *x.shape[1:]).contiguous()
    return rows.view(x.shape[0] * n, *x.shape[1:])

def apply_controls(model: LlamaModel, state: DecodeState, logits: torch.Tensor,
                   drafts: list[torch.Tensor], temperature: torch.Tensor, live: torch.Tensor,
                   grammar: bool) -> torch.Tensor | None:
    """In place on logits [B, K + 1, V] (the verify's, row r's positions together), in the
    plain sampler's order (capture/iteration.py): token mask, logit bias, penalties, min_p.
    drafts: the K draft tokens, one [B] tensor per step; temperature: [B * (K + 1)]; live: the
    rows the step moves on (bool [B]). Counts each draft into the penalised rows' slots.
    Returns the rows that take no drafts (bool [B]), or None without grammar rows."""
    ops, pen = model.ops, state.penalties
    b, k1, v = logits.shape
    rows = slice(0, b)
    no_drafts = None
    if grammar:
        on = state.mask_on[rows]
        ops.apply_token_mask(logits[:, 0], state.token_mask[rows], on)
        no_drafts = on != 0
    slots = state.penalty_slots[rows]
    flat = logits.view(b * k1, v)
    per_position = repeat_rows(slots, k1)
    ops.apply_logit_bias(flat, per_position, pen.bias_ids, pen.bias_vals)
    for j in range(k1):
        if j:  # position j follows draft j - 1
            ops.count_tokens(pen.counts, pen.flags, pen.seen_ids, pen.num_seen, slots,
                             drafts[j - 1], live)
        ops.apply_penalties(logits[:, j], slots, pen.counts, pen.flags, pen.seen_ids,
                            pen.num_seen, pen.presence, pen.frequency, pen.repetition)
    ops.apply_min_p(flat, per_position, temperature, pen.log_min_p)
    return no_drafts


def recount(model: LlamaModel, state: DecodeState, drafts: torch.Tensor, tokens: torch.Tensor,
            count: torch.Tensor, live: torch.Tensor) -> None:
    """After apply_controls counted every draft: leaves the slots counting what the step
    emits, tokens[:, :count] (the accepted drafts, then one more), for live rows. drafts
    [B, K], tokens [B, K + 1], count [B] in 1..K + 1. One scatter of -1 for each draft from
    index count - 1 on (not emitted), then the last emitted token is counted as a plain step
    counts its token, which lists it if it is new. A draft taken back stays listed, with the
    count it is left with (maybe 0: the penalties then leave it as they leave unseen ones)."""
    pen = state.penalties
    b, k = drafts.shape
    slots = state.penalty_slots[:b]
    j = torch.arange(k, device=drafts.device)[None, :]
    add = -(j >= (count - 1)[:, None]).long() * (live & (slots > 0)).long()[:, None]
    vocab = pen.counts.shape[1]
    pen.counts.view(-1).scatter_add_(0, (slots[:, None] * vocab + drafts).reshape(-1),
                                     add.reshape(-1).to(pen.counts.dtype))
    last = tokens.gather(1, (count - 1)[:, None])[:, 0]
    model.ops.count_tokens(pen.counts, pen.flags, pen.seen_ids, pen.num_seen, slots, last,
                           live)


class Hold:
    """The rows whose verify emits nothing this step (a grammar row in its joining step):
    their input, position and step as the prefill left them, put back after the advance, and
    their count set to 0."""

    def __init__(self, state: DecodeState, bucket: int):
        rows = slice(0, bucket)
        self.held = state.mask_on[rows] == MASK_HOLD
        self.kept = [t[rows].clone() for t in (state.input_ids, state.positions, state.steps)]

    def restore(self, state: DecodeState) -> None:
        rows = slice(0, self.held.shape[0])
        for t, kept in zip((state.input_ids, state.positions, state.steps), self.kept):
            t[rows] = torch.where(self.held, kept, t[rows])
        state.out_count[rows] = torch.where(self.held, 0, state.out_count[rows])
