"""Batch-invariant projections (EngineConfig.batch_invariant): the kernel of
kernels/linear_triton.py with one launch config per weight shape, whatever the row count.
Reference: kernels/linear.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

# through the module: tests patch its functions (tests/test_triton_compile.py)
from . import linear_triton as lt
from .tuning import DEFAULT, LinearTuning


def invariant_config(n: int, k: int, t: LinearTuning = DEFAULT.linear) -> lt.LinearConfig:
    """One config per weight shape, whatever the row count: a row's sum then runs over the same
    K blocks with the same tensor-core tiles in the same order at every batch size, so a draft
    step over B rows and a verify over B * (K + 1) rows give bitwise the same logits for the
    same token at the same position, and a prompt's KV does not depend on the prefill batch it
    was packed into."""
    block_n, block_k = t.invariant_block_n, t.invariant_block_k
    split = lt._split_k(triton.cdiv(n, block_n), t.invariant_split_programs, k, block_k)
    return lt.LinearConfig(64, block_n, block_k, split)


# No row limit (max_rows=None below): prefills must be invariant too, since sync and async mode
# admit requests at different steps and so pack different prefill batches (long prefills pay
# for it: this kernel is no GEMM for thousands of rows).
def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     t: LinearTuning = DEFAULT.linear) -> torch.Tensor:
    if not lt.supported(x, weight, 1, bias, max_rows=None):
        return F.linear(x, weight, bias)
    return lt._launch(x, None, None, 0.0, weight, bias, invariant_config(*weight.shape, t),
                      t=t)[0]


def silu_mul_linear_invariant(gate_up: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None,
                              t: LinearTuning = DEFAULT.linear) -> torch.Tensor:
    if not lt.supported(gate_up, weight, 2, bias, max_rows=None):
        return lt.silu_mul_then_linear(gate_up, weight, bias)
    return lt._launch(gate_up, None, None, 0.0, weight, bias, invariant_config(*weight.shape, t),
                      gated=True, t=t)[0]


def norm_linear_invariant(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          bias: torch.Tensor | None = None, t: LinearTuning = DEFAULT.linear
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm stays its own kernel: fused, its mean square would be summed in the
    projection's K blocks, and re-read by every program of a large verify batch."""
    normed, summed = lt._norm(x, residual, norm_weight, eps)
    return linear_invariant(normed, weight, bias, t), summed
