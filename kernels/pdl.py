"""Programmatic dependent launch (PDL, sm_90+): which Triton kernels launch as dependents.

A kernel launched as a programmatic dependent may be scheduled as soon as every program of the
kernel before it has started (or called `gdc_launch_dependents`), instead of after that kernel
has finished and flushed. It must execute `gdc_wait` before reading anything an earlier kernel
wrote and before writing anything at all; `gdc_wait` returns once the previous kernel is
complete and its writes are visible. What runs before the wait is the gain: the launch and the
program start-up, and for the projections the first weight tile (weights are never written
during decode).

GRAPHEXEC_PDL picks the kernels:
  "all" (the default): the Triton projections, and RMSNorm, rope + KV write, decode attention,
      silu * mul and the step's tail after the LM head (stop-token mask, sampling, argmax,
      advance), which wait first thing and signal their dependents, so the projection after
      them can fetch its weights while they run;
  "off": none.
Every kernel launched normally still waits for the whole previous kernel, as before.

A kernel's PDL variant is compiled separately and may round differently in the last bit (about
one projection output in a thousand differed by one ulp on the H100): runs with different
GRAPHEXEC_PDL settings, or on GPUs before sm_90, are not bitwise comparable with each other,
batch-invariant mode included. Within one setting everything stays deterministic.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = True
except ImportError:  # pragma: no cover - a Triton without PDL: the kernels launch normally
    AVAILABLE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

MODES = ("off", "all")


def mode_from_env() -> str:
    value = os.environ.get("GRAPHEXEC_PDL", "all").strip().lower()
    if value not in MODES:
        raise ValueError(f"GRAPHEXEC_PDL={os.environ['GRAPHEXEC_PDL']!r} is not one of "
                         f"{MODES}")
    return value


mode = mode_from_env()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled(x: torch.Tensor) -> bool:
    """Whether a kernel working on x launches as a programmatic dependent: mode "all" on an
    sm_90+ GPU."""
    if mode == "off":
        return False
    if not (AVAILABLE and not _INTERPRET and x.is_cuda):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


@triton.jit
def prologue(PDL: tl.constexpr):
    """First thing in a kernel that may be launched as a dependent: let the next
    kernel launch, then wait for the previous one. Nothing may be read or written before it."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
