"""Triton decode metadata and advance: one launch each where the references take about six.
Same results as kernels/advance.py; grids come from tensor shapes, so both are graph-safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _metadata_kernel(pos_ptr, bt_ptr, slot_ptr, len_ptr, B, stride_bt, last_col, BLOCK_SIZE,
                     BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < B
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    col = tl.minimum(pos // BLOCK_SIZE, last_col)
    block = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + col, mask=ok, other=0)
    tl.store(slot_ptr + rows, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=ok)
    tl.store(len_ptr + rows, (pos + 1).to(tl.int32), mask=ok)


def decode_metadata(positions: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = positions.shape[0]
    slots = torch.empty(b, dtype=torch.int64, device=positions.device)
    lens = torch.empty(b, dtype=torch.int32, device=positions.device)
    if b == 0:
        return slots, lens
    assert block_tables.stride(1) == 1 and positions.stride(0) == 1
    block = min(1024, triton.next_power_of_2(b))
    _metadata_kernel[(triton.cdiv(b, block),)](positions, block_tables, slots, lens, b,
                                                block_tables.stride(0),
                                                block_tables.shape[1] - 1, block_size, BLOCK=block)
    return slots, lens


@triton.jit
def _advance_kernel(tok_ptr, ids_ptr, pos_ptr, step_ptr, n_ptr, out_ptr, stride_out, B,
                    BLOCK: tl.constexpr, HAS_OUT: tl.constexpr, PDL: tl.constexpr):
    pdl.prologue(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < B
    live = rows < tl.load(n_ptr)
    tok = tl.load(tok_ptr + rows, mask=ok, other=0)
    if HAS_OUT:
        tl.store(out_ptr + rows.to(tl.int64) * stride_out, tok, mask=ok)
    tl.store(ids_ptr + rows, tl.where(live, tok, 0), mask=ok)
    one = live.to(tl.int64)
    tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=ok, other=0) + one, mask=ok)
    tl.store(step_ptr + rows, tl.load(step_ptr + rows, mask=ok, other=0) + one, mask=ok)


def advance(tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
            steps: torch.Tensor, num_rows: torch.Tensor,
            sampled_out: torch.Tensor | None = None) -> None:
    b = tokens.shape[0]
    if b == 0:
        return
    for t in (tokens, input_ids, positions, steps):
        assert t.stride(0) == 1 and t.dtype == torch.int64
    if sampled_out is not None:
        assert sampled_out.shape == tokens.shape and sampled_out.dtype == torch.int64
    block = min(1024, triton.next_power_of_2(b))
    dependent = pdl.enabled(tokens)
    _advance_kernel[(triton.cdiv(b, block),)](
        tokens, input_ids, positions, steps, num_rows,
        sampled_out if sampled_out is not None else tokens,
        sampled_out.stride(0) if sampled_out is not None else 0, b, BLOCK=block,
        HAS_OUT=sampled_out is not None, PDL=dependent, launch_pdl=dependent)


@triton.jit
def _spec_advance_kernel(tok_ptr, count_ptr, draft_ptr, ids_ptr, pos_ptr, step_ptr, n_ptr,
                         out_tok_ptr, out_count_ptr, B, stride_out, stride_count,
                         K1: tl.constexpr,
                         GREEDY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.prologue(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_K)
    ok = rows < B
    live = rows < tl.load(n_ptr)
    cand_ok = ok[:, None] & (cols < K1)[None, :]
    tok = tl.load(tok_ptr + rows[:, None] * K1 + cols[None, :], mask=cand_ok, other=0)
    if GREEDY:
        # count = 1 + the length of the leading run of drafts equal to the target's argmax
        d_ok = ok[:, None] & (cols < K1 - 1)[None, :]
        d = tl.load(draft_ptr + rows[:, None] * (K1 - 1) + cols[None, :], mask=d_ok, other=-1)
        miss = d_ok & (d != tok)
        first_miss = tl.min(tl.where(miss | ~d_ok, cols[None, :], BLOCK_K), axis=1)
        count = (tl.minimum(first_miss, K1 - 1) + 1).to(tl.int64)
    else:
        count = tl.load(count_ptr + rows, mask=ok, other=1)
    tl.store(out_tok_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], tok,
             mask=cand_ok)
    tl.store(out_count_ptr + rows.to(tl.int64) * stride_count, count, mask=ok)
    last = tl.sum(tl.where(cols[None, :] == (count - 1)[:, None], tok, 0), axis=1)
    step = tl.where(live, count, 0)
    tl.store(ids_ptr + rows, tl.where(live, last, 0), mask=ok)
    tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=ok, other=0) + step, mask=ok)
    tl.store(step_ptr + rows, tl.load(step_ptr + rows, mask=ok, other=0) + step, mask=ok)


def spec_advance(tokens: torch.Tensor, count: torch.Tensor | None, draft: torch.Tensor | None,
                 input_ids: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor,
                 num_rows: torch.Tensor, out_tokens: torch.Tensor,
                 out_count: torch.Tensor) -> None:
    """kernels/advance.py spec_advance_ref in one launch (the reference takes about 15)."""
    b, k1 = tokens.shape
    if b == 0:
        return
    tokens = tokens.contiguous()
    for t in (input_ids, positions, steps):
        assert t.stride(0) == 1 and t.dtype == torch.int64
    # the step's outputs may be strided views (capture/state.py packs tokens and count)
    assert out_tokens.shape == tokens.shape and out_tokens.stride(1) == 1
    assert out_count.shape == (b,) and out_count.dtype == torch.int64
    greedy = count is None
    if not greedy:
        count = count.contiguous()
    if greedy:
        draft = draft.contiguous()
        assert draft.shape == (b, k1 - 1)
    block = min(256, triton.next_power_of_2(b))
    dependent = pdl.enabled(tokens)
    _spec_advance_kernel[(triton.cdiv(b, block),)](
        tokens, tokens if greedy else count, draft if greedy else tokens, input_ids, positions,
        steps, num_rows, out_tokens, out_count, b, out_tokens.stride(0), out_count.stride(0),
        K1=k1, GREEDY=greedy,
        BLOCK=block, BLOCK_K=triton.next_power_of_2(k1), PDL=dependent, launch_pdl=dependent)
