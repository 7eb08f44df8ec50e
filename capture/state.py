"""DecodeState: the device-resident state of the running batch, in static buffers.

Row i of every buffer belongs to the request in row i of the host's running list. Buffers have
max_rows + 1 rows: the last one is the inert row (token 0, position 0, every block-table entry the
scratch block), copied into every row that holds no request, so padding rows in a bucket write
their K/V into the scratch block and never into a live one.
"""
from __future__ import annotations

import torch

from ..plan import StepDelta
from .penalties import PenaltyState

MAX_STOP_IDS = 16  # ids masked on the device while a row is below min_tokens
_NEW_ROW_INTS = 7  # seed, min_tokens, top_k, input_id, position, step, penalty slot


class DecodeState:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int,
                 scratch_block: int, device: torch.device, num_logprobs: int = 20,
                 tokens_per_step: int = 1, penalties: bool = False):
        self.max_rows = max_rows
        self.inert_row = max_rows
        self.scratch_block = scratch_block
        # One column past the context limit stays on the scratch block: a row that finished at
        # the limit still runs in the step that was launched before the host saw it finish.
        self.max_cols = max_blocks_per_seq + 1
        self.device = device
        r = max_rows + 1
        i64 = dict(device=device, dtype=torch.int64)
        # The per-row numbers a batch change moves together are rows of two buffers, so that a
        # compaction gathers each buffer with one index_select and a joining row writes each
        # with one index_put: under churn the batch changes nearly every step, and each eager
        # op there is host time before the replay. Every field is a contiguous view; rows are
        # padded to 16 elements so that every view starts 16-byte aligned.
        pad = -(-r // 16) * 16
        self._row_ints = torch.zeros(_NEW_ROW_INTS, pad, **i64)
        self._row_floats = torch.zeros(2, pad, device=device, dtype=torch.float32)
        # (the order of pack_delta's new-row columns)
        (self.seeds, self.min_tokens, self.top_k, self.input_ids, self.positions,
         self.steps, self.penalty_slots) = (row[:r] for row in self._row_ints)
        # positions: where the next forward writes (seq_len = +1); steps: the index of the
        # output token the next sample draws
        self.temperature, self.top_p = (row[:r] for row in self._row_floats)
        self.top_p.fill_(1.0)
        self.stop_ids = torch.full((r, MAX_STOP_IDS), -1, **i64)
        self.block_tables = torch.full((r, self.max_cols), scratch_block, device=device,
                                       dtype=torch.int32)
        self.num_rows = torch.zeros(1, **i64)  # rows holding a request; read inside graphs
        # what penalised rows read, in slots of their own (None: no row may use penalties)
        self.penalties = (PenaltyState(max_rows, vocab_size, device) if penalties else None)
        # Grammar rows: each step that has one, the host writes every row's token mask and a
        # flag (structured.MASK_ON, MASK_HOLD) into one int64 buffer, one H2D copy (engine.py).
        words = -(-vocab_size // 64)
        self.grammar_rows = torch.zeros(r, words + 1, **i64) if penalties else None
        if penalties:
            self.token_mask = self.grammar_rows[:, :words].view(torch.int32)
            self.mask_on = self.grammar_rows[:, words]
        # Set by a runner whose steps take their masks after launch (capture/mask_gate.py).
        self.mask_gate = None
        # Outputs of the last step, read back by the host one step later. A step emits up to
        # tokens_per_step tokens per row (K+1 when speculating); out_count says how many.
        w, f32 = tokens_per_step, dict(device=device, dtype=torch.float32)
        self.tokens_per_step = w
        # Tokens and count share one buffer (the count is the last column), so the host reads
        # both back with one copy a step rather than two.
        self.out_packed = torch.zeros(r, w + 1, **i64)
        self.out_tokens = self.out_packed[:, :w]
        self.out_count = self.out_packed[:, w]
        self.out_count.fill_(1)
        self.out_logprob = torch.zeros(r, w, **f32)
        self.out_top_logprobs = torch.zeros(r, w, num_logprobs, **f32)
        self.out_top_ids = torch.zeros(r, w, num_logprobs, **i64)
        # (buffer, its row dimension): what a compaction gathers
        self._row_fields = [(self._row_ints[:, :r], 1), (self._row_floats[:, :r], 1),
                            (self.stop_ids, 0), (self.block_tables, 0)]

    def apply_delta(self, delta: StepDelta, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Applies a delta whose numbers were packed by `pack_delta` and already copied to the
        device as `ints` and `floats`. Host-known sizes slice them; nothing is read back."""
        o = 0
        if delta.row_map is not None:
            gather = ints[o:o + self.max_rows + 1]
            o += self.max_rows + 1
            for buf, dim in self._row_fields:
                buf.copy_(buf.index_select(dim, gather))
        n_new = len(delta.new_rows)
        if n_new:
            rows = ints[o:o + n_new]
            width = _NEW_ROW_INTS + MAX_STOP_IDS
            cols = ints[o + n_new:o + (1 + width) * n_new].view(width, n_new)
            o += (1 + width) * n_new
            self._row_ints[:, rows] = cols[:_NEW_ROW_INTS]
            self.stop_ids[rows] = cols[_NEW_ROW_INTS:].t()
            self._row_floats[:, rows] = floats[:2 * n_new].view(2, n_new)
        n_ent = len(delta.block_entries)
        if n_ent:
            e = ints[o:o + 3 * n_ent].view(3, n_ent)
            o += 3 * n_ent
            self.block_tables[e[0], e[1]] = e[2].to(torch.int32)
        self.num_rows.copy_(ints[o:o + 1])


def pack_delta(delta: StepDelta, max_rows: int,
               slots: list[int] | None = None) -> tuple[list[int], list[float]]:
    """Flattens a delta into one int list and one float list (one H2D copy each). slots: each
    new row's penalty slot (PenaltyState.assign; None: all 0)."""
    ints: list[int] = []
    if delta.row_map is not None:
        gather = list(delta.row_map) + [max_rows] * (max_rows + 1 - len(delta.row_map))
        ints += gather
    rows = delta.new_rows
    if rows:
        ints += [r.row for r in rows]
        ints += [r.seed for r in rows]
        ints += [r.min_tokens for r in rows]
        ints += [r.top_k for r in rows]
        ints += [r.input_id for r in rows]
        ints += [r.position for r in rows]
        ints += [r.step for r in rows]
        ints += slots if slots is not None else [0] * len(rows)
        for j in range(MAX_STOP_IDS):
            ints += [r.stop_ids[j] if j < len(r.stop_ids) else -1 for r in rows]
    for name_idx in range(3):
        ints += [e[name_idx] for e in delta.block_entries]
    ints.append(delta.num_rows)
    floats = [r.temperature for r in rows] + [r.top_p for r in rows]
    return ints, floats
