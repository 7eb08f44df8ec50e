"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same rounding points as HF Llama: normalise in fp32, cast back, then scale by the weight.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual), x + residual); the sum is rounded to x's dtype like HF does."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
