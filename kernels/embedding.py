"""The token embedding gather, PyTorch reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids: [T] token ids; weight: [vocab, hidden]. Returns [T, hidden] rows of weight."""
    return F.embedding(ids, weight)
