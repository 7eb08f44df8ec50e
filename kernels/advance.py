"""Per-iteration decode metadata and the device-side advance: PyTorch references.

Both run inside the captured iteration. `decode_metadata` turns each row's position and block
table into the flat cache slot its new K/V goes to and the number of keys it attends; `advance`
moves live rows on by the token just sampled. Padding rows (index >= num_rows) stay inert: token
0, position 0, so with the inert block table they write only into the scratch block.
"""
from __future__ import annotations

import torch


def decode_metadata_ref(positions: torch.Tensor, block_tables: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B] int64; block_tables: [B, M] int32. Returns (slot_mapping [B] int64,
    seq_lens [B] int32)."""
    col = positions // block_size
    block = block_tables.gather(1, col[:, None]).squeeze(1).long()
    return block * block_size + positions % block_size, (positions + 1).to(torch.int32)


def advance_ref(tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                steps: torch.Tensor, num_rows: torch.Tensor,
                sampled_out: torch.Tensor | None = None) -> None:
    """In place, for rows i < num_rows (a 1-element device tensor): input_ids[i] = tokens[i],
    positions[i] += 1, steps[i] += 1. Rows past it are left as they are (input id 0).
    sampled_out, when given (a [B] view, any stride), receives every row's token as sampled:
    the step's output, written here so it costs no launch of its own."""
    if sampled_out is not None:
        sampled_out.copy_(tokens)
    live = (torch.arange(tokens.shape[0], device=tokens.device) < num_rows).long()
    input_ids.copy_(tokens * live)
    positions.add_(live)
    steps.add_(live)
