"""Grammar token masks: PyTorch reference.

A row's mask holds one bit per vocabulary entry (bit i % 32 of int32 word i // 32, as xgrammar
writes it); tokens whose bit is 0 are set to -inf, in place, before penalties and sampling.
Rows whose `on` flag is 0 are left as they are (they have no grammar, and their mask words are
not written)."""
from __future__ import annotations

import torch


def apply_token_mask_ref(logits: torch.Tensor, mask: torch.Tensor,
                         on: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; mask [B, W] int32 with W * 32 >= V (rows may be strided); on [B]
    (nonzero: apply; any stride)."""
    v = logits.shape[1]
    idx = torch.arange(v, device=logits.device)
    bits = (mask.long()[:, idx // 32] >> (idx % 32)) & 1
    return logits.masked_fill_((bits == 0) & (on != 0)[:, None], float("-inf"))
