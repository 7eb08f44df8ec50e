"""The projections of the decode step, PyTorch reference.

linear_ref is F.linear. norm_linear_ref is what the model computes before its qkv and gate_up
projections, RMSNorm (after the residual add) then the projection, with the rounding points of
kernels/rmsnorm.py: the Triton version fuses the norm into the projection's prologue and must
give the same normed input, up to the projection's own summation order. silu_mul_linear_ref is
the MLP's down projection with its activation, which the Triton version computes in the
prologue.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import silu_mul_ref
from .rmsnorm import add_rms_norm_ref, rms_norm_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N]."""
    return F.linear(x, weight, bias)


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (linear(rms_norm(x + residual)), x + residual); without a residual the second
    is x itself (the first layer's residual stream starts at the embeddings)."""
    if residual is None:
        normed, summed = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, summed = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MLP's down projection of silu(gate) * up; gate_up: [M, 2 * I], gate first."""
    return F.linear(silu_mul_ref(gate_up), weight, bias)
