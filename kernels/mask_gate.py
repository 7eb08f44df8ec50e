"""Grammar masks handed to a step after it was launched: PyTorch reference.

The host writes a step's mask rows into pinned memory while the step's forward runs, then raises
a flag there to the last ticket released (capture/mask_gate.py). The step waits until the flag
reaches its ticket, then copies the rows to the device. want = [ticket, int64 words to
copy]. The reference cannot wait (nothing else runs while it does): the flag must already be up.
"""
from __future__ import annotations

import torch


def await_masks_ref(flag: torch.Tensor, want: torch.Tensor, src: torch.Tensor,
                    dst: torch.Tensor) -> torch.Tensor:
    """flag [1] int64 (the last ticket released); want [2] int64; src, dst int64, contiguous.
    Copies the first want[1] words of src into dst."""
    ticket, n = (int(v) for v in want.tolist())
    if int(flag[0]) < ticket:
        raise RuntimeError(f"mask ticket {ticket} was not released (flag at {int(flag[0])})")
    dst.view(-1)[:n].copy_(src.view(-1)[:n])
    return dst
