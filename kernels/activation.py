"""The gated MLP activation, PyTorch reference: silu(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I], gate first. Returns [T, I] in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
