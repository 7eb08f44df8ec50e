"""Grammar masks handed to a step after it was launched: PyTorch reference.

The host writes a step's mask rows into pinned memory while the step's forward runs, then raises
a flag there to the last ticket released (capture/mask_gate.py). The step waits until the flag
reaches its ticket, then copies the rows to the device. Tickets are counted on the device, one
per waiting step, so a step needs no host input to know its own. The reference cannot wait
(nothing else runs while it does): the flag must already be up.

The device rows are in DecodeState.grammar_rows' layout: mask words, then the row's grammar
flag in its last word. The host keeps masks and flags apart (capture/mask_gate.py says why).
Every row in use gets its flag; only rows whose flag is set get their mask words (16 KB a row
over a 128k vocabulary, read across PCIe), so one constrained row among 64 costs one row's
copy.
"""
from __future__ import annotations

import torch


def await_masks_ref(flag: torch.Tensor, passed: torch.Tensor, num_rows: torch.Tensor,
                    masks: torch.Tensor, flags: torch.Tensor, dst: torch.Tensor
                    ) -> torch.Tensor:
    """flag [1] int64 (the last ticket released); passed [1] int64 (tickets the device has
    gone through: this step's is passed + 1); num_rows [1] int64 (the rows holding a
    request); masks [R, M] int32, each row's mask words as the host filled them; flags [R]
    int64; dst [R, W] int64, contiguous, 2 * (W - 1) >= M. Copies the first num_rows flags
    into dst's last column, and the masks of rows whose flag is set into the int32 view of
    the rest of their dst row; counts the ticket as passed."""
    ticket = int(passed[0]) + 1
    if int(flag[0]) < ticket:
        raise RuntimeError(f"mask ticket {ticket} was not released (flag at {int(flag[0])})")
    n = int(num_rows[0])
    dst[:n, -1] = flags[:n]
    on = torch.nonzero(flags[:n]).flatten()
    dst[:, :-1].view(torch.int32)[on, :masks.shape[1]] = masks[on]
    passed.add_(1)
    return dst
