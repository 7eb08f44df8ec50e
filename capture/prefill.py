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

# How many sequences one prefill step packs at most (the captured graphs' fixed count).
MAX_PREFILL_SEQS = 16
# The smallest token bucket. Up to 64 rows the projections run the decode-tuned Triton kernels
# (kernels/triton_ops.py): on the H100 a 64-token prefill of llama-1b took 1.36 ms where 16-32
# token ones on cuBLAS took 1.73 (tools/profile_churn.py, 2026-11-25), so smaller buckets only
# cost time.
MIN_TOKEN_BUCKET = 64


@dataclass
class PrefillChunk:
    """One sequence's share of a prefill step: its tokens at positions start.. , written into
    `blocks`. The last chunk of a prompt samples (or, for a request recomputing after eviction,
    resumes from its last token) into decode row `row`; an earlier chunk has row None."""

    token_ids: list[int]
    start: int  # position of token_ids[0]: the KV of positions < start is already written
    blocks: list[int]
    row: int | None = None  # the DecodeState row it joins as, on its last chunk
    step: int = 0  # index of the next output token of this request
    resume_token: int | None = None  # evicted request: its last token, next input; no sample

    @property
    def samples(self) -> int:
        """Tokens this chunk emits: 1 for a prompt's last chunk, 0 otherwise."""
        return int(self.row is not None and self.resume_token is None)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


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


def token_buckets(max_tokens: int) -> list[int]:
    """The captured prefill sizes: every 64 tokens to 512 and every 256 beyond, and max_tokens
    itself. A prefill is compute-bound, so padding costs its share of
    the time: steps this fine keep it under about 15% of a large prefill, and the scheduler
    cuts chunks to a bucket's size (bucket_floor) so a long prompt's chunks pad nothing."""
    out, b = [], MIN_TOKEN_BUCKET
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 64 else b + (64 if b < 512 else 256)
    return out + [max_tokens]


def bucket_floor(buckets: list[int], tokens: int) -> int:
    """The largest bucket not above `tokens` (the smallest bucket if none is)."""
    return max((b for b in buckets if b <= tokens), default=buckets[0])
