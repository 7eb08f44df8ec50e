"""A step's prompt chunks, packed: what the step writes into the paged KV cache, and for each
prompt whose last chunk this is, which DecodeState row its first token and next inputs go to
(capture/mixed.py runs them, beside the decode rows or alone).

A step's chunks are packed into one varlen batch described by `PrefillMeta`, whose tensors are all
views of one int64 buffer that the host fills with a single H2D copy. With CUDA graphs the buffer
is static and the batch is padded to a token bucket (and a fixed number of sequences), so the
whole prefill is one graph replay per bucket: an admission costs the host one copy and one replay
instead of hundreds of eager launches. Padding never touches a live row or block: pad tokens
write their K/V into the scratch block and belong to no sequence, pad sequences are empty, and
every sequence that does not sample (a partial chunk, a pad) writes its outputs into the inert
row with the inert row's own values (token 0, position 0, step 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..plan import PrefillChunk


@dataclass
class PrefillMeta:
    """Device views of one packed prefill batch of `num_tokens` tokens and `num_seqs` sequences
    (real or padded). Every per-sequence value is indexed by sequence, in chunk order."""

    ids: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat KV slot of each token
    cu_seqlens: torch.Tensor  # [S + 1] query offsets
    seq_lens: torch.Tensor  # [S] keys each sequence attends to: its cached prefix + chunk
    rows: torch.Tensor  # [S] DecodeState row the sample goes to (the inert row if none)
    steps: torch.Tensor  # [S]
    samples: torch.Tensor  # [S] 1: sample the first token; 0: no token
    resume: torch.Tensor  # [S] next input when not sampling (0 for the inert row)
    next_position: torch.Tensor  # [S] the row's next position (0 for the inert row)
    block_tables: torch.Tensor  # [S, C]
    # [1] decode rows in front of the chunks' tokens (a mixed step, capture/mixed.py); the
    # chunks' tokens start there, and so does cu_seqlens
    num_decode: torch.Tensor

    @staticmethod
    def size(num_tokens: int, num_seqs: int, cols: int) -> int:
        return 3 * num_tokens + 7 * num_seqs + 2 + num_seqs * cols

    @classmethod
    def view(cls, buf: torch.Tensor, num_tokens: int, num_seqs: int, cols: int) -> "PrefillMeta":
        t, s = num_tokens, num_seqs
        parts = buf[:cls.size(t, s, cols)].split([t, t, t, s + 1] + [s] * 6 + [s * cols, 1])
        return cls(*parts[:10], parts[10].view(s, cols), parts[11])


def pack_prefill(chunks: list[PrefillChunk], num_tokens: int, num_seqs: int, cols: int,
                 block_size: int, scratch_block: int, inert_row: int,
                 num_decode: int = 0) -> np.ndarray:
    """The int64 array PrefillMeta.view reads, padded to num_tokens tokens and num_seqs
    sequences; the chunks' tokens start after num_decode places the device fills (a mixed
    step). Filled with numpy, a chunk at a time: on CUDA the block tables alone are
    MAX_PREFILL_SEQS x max_cols entries, mostly padding, and building them as Python lists
    cost about a millisecond of host time on every admitting step."""
    real = sum(len(c.token_ids) for c in chunks) + num_decode
    if real > num_tokens or len(chunks) > num_seqs:
        raise RuntimeError(f"{real} tokens in {len(chunks)} chunks exceed the "
                           f"{num_tokens}-token, {num_seqs}-sequence prefill")
    t, s = num_tokens, num_seqs
    out = np.zeros(PrefillMeta.size(t, s, cols), dtype=np.int64)
    ids, pos, slots, cu, lens, rows, steps, samples, resume, next_pos, tables, n_dec = np.split(
        out, np.cumsum([t, t, t, s + 1] + [s] * 6 + [s * cols]))
    # pad tokens (and the decode rows' places, for the prefill attention) write the scratch block
    slots[:] = scratch_block * block_size
    rows[:] = inert_row  # pad sequences, and chunks that end no prompt, sample into it
    tables[:] = scratch_block
    tables = tables.reshape(s, cols)
    n_dec[0] = num_decode
    at = cu[0] = num_decode
    for i, c in enumerate(chunks):
        if len(c.blocks) * block_size < c.end:  # the scheduler reserves them first
            raise RuntimeError(f"{len(c.blocks)} blocks for {c.end} positions")
        n = len(c.token_ids)
        blocks = np.asarray(c.blocks, dtype=np.int64)
        p = np.arange(c.start, c.end)
        ids[at:at + n] = c.token_ids
        pos[at:at + n] = p
        slots[at:at + n] = blocks[p // block_size] * block_size + p % block_size
        tables[i, :min(len(blocks), cols)] = blocks[:cols]
        at += n
        cu[i + 1] = at
        lens[i] = c.end
        samples[i] = c.samples
        if c.row is not None:
            rows[i], steps[i], next_pos[i] = c.row, c.step, c.end
            resume[i] = c.resume_token or 0
    cu[len(chunks) + 1:] = at
    return out
