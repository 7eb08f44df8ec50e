"""Triton silu(gate) * up in one pass (the reference takes two kernels and an intermediate).
Rounding as in the reference: silu is computed in fp32 and rounded to the input dtype before the
product, which is computed in fp32 and rounded again (what torch does for bf16/fp16 tensors)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .tuning import DEFAULT, ElementwiseTuning


def _new(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + cols, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor,
             tuning: ElementwiseTuning = DEFAULT.elementwise) -> torch.Tensor:
    t, two_i = gate_up.shape
    i = two_i // 2
    out = _new((t, i), gate_up.dtype, gate_up.device)
    if t == 0:
        return out
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    block = min(tuning.silu_block, triton.next_power_of_2(i))
    dependent = pdl.enabled(gate_up)
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0),
                                                 out.stride(0), BLOCK=block, PDL=dependent,
                                                 num_warps=tuning.warps,
                                                 launch_pdl=dependent)
    return out
