"""Per-iteration decode metadata and the device-side advance: PyTorch references.

Both run inside the captured iteration. `decode_metadata` turns each row's position and block
table into the flat cache slot its new K/V goes to and the number of keys it attends; `advance`
moves live rows on by the token just sampled. Padding rows (index >= num_rows) stay inert: token
0, position 0, so with the inert block table they write only into the scratch block.
"""
from __future__ import annotations

import torch

from .rejection import accept_argmaxes


def decode_metadata_ref(positions: torch.Tensor, block_tables: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B] int64; block_tables: [B, M] int32. Returns (slot_mapping [B] int64,
    seq_lens [B] int32). A position past the table's last column maps into that column (the
    scratch block of capture/state.py: a speculative step drafts past a row's context limit)."""
    col = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
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


def spec_advance_ref(tokens: torch.Tensor, count: torch.Tensor | None,
                     draft: torch.Tensor | None, input_ids: torch.Tensor,
                     positions: torch.Tensor, steps: torch.Tensor, num_rows: torch.Tensor,
                     out_tokens: torch.Tensor, out_count: torch.Tensor) -> None:
    """The end of a speculative iteration, in place. tokens [B, K+1]: the row's candidates (for
    greedy rows the target's argmaxes); count [B]: how many of them are emitted, or None to
    take the greedy rule from draft [B, K] (the drafts accepted while they equal the target's
    argmax, plus one). Writes out_tokens / out_count (the step's output), and for live rows
    moves input_ids to the last emitted token and positions and steps on by the count;
    padding rows get input id 0 and stay where they are."""
    if count is None:
        tokens, count = accept_argmaxes(tokens, draft)
    out_tokens.copy_(tokens)
    out_count.copy_(count)
    live = (torch.arange(tokens.shape[0], device=tokens.device) < num_rows).long()
    last = tokens.gather(1, (count - 1)[:, None]).squeeze(1)
    input_ids.copy_(last * live)
    positions.add_(count * live)
    steps.add_(count * live)
