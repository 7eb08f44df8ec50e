"""Triton decode metadata and advance: one launch each where the references take about six.
Same results as kernels/advance.py; grids come from tensor shapes, so both are graph-safe."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl


@triton.jit
def _metadata_kernel(pos_ptr, bt_ptr, slot_ptr, len_ptr, B, stride_bt, BLOCK_SIZE,
                     BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < B
    pos = tl.load(pos_ptr + rows, mask=ok, other=0).to(tl.int64)
    block = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=ok, other=0)
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
                                                block_tables.stride(0), block_size, BLOCK=block)
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
    dependent = pdl.enabled(tokens, projection=False, tail=True)
    _advance_kernel[(triton.cdiv(b, block),)](
        tokens, input_ids, positions, steps, num_rows,
        sampled_out if sampled_out is not None else tokens,
        sampled_out.stride(0) if sampled_out is not None else 0, b, BLOCK=block,
        HAS_OUT=sampled_out is not None, PDL=dependent, launch_pdl=dependent)
