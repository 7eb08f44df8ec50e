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
      them can fetch its weights while they run (llama-1b batch 1 on an H100: 1.173 ms a
      decode step against 1.192 with "projections", docs/benchmarks.md);
  "projections" (or "1"): the Triton projections only (kernels/linear_triton.py), 2.5-3.3%
      faster decode steps at batch 1 than "off";
  "off" (or "0"): none.
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

MODES = ("off", "projections", "all")
_ALIASES = {"0": "off", "1": "projections"}


def mode_from_env() -> str:
    value = os.environ.get("GRAPHEXEC_PDL", "all").strip().lower()
    value = _ALIASES.get(value, value)
    if value not in MODES:
        raise ValueError(f"GRAPHEXEC_PDL={os.environ['GRAPHEXEC_PDL']!r} is not one of "
                         f"{MODES} (or 0 / 1)")
    return value


mode = mode_from_env()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# The tail kernels (after the LM head) as dependents too, under "all"; tools/decode_variants.py
# turns it off to measure it.
TAIL = True


def enabled(x: torch.Tensor, projection: bool, tail: bool = False) -> bool:
    """Whether a kernel working on x launches as a programmatic dependent. projection: the
    Triton projections (mode "projections" or "all"); the other kernels need mode "all", and
    tail kernels (stop-token mask, sampling, argmax, advance) TAIL as well."""
    if mode == "off" or (mode == "projections" and not projection) or (tail and not TAIL):
        return False
    if not (AVAILABLE and not _INTERPRET and x.is_cuda):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


@triton.jit
def prologue(PDL: tl.constexpr):
    """First thing in a kernel that may be launched as a dependent (mode "all"): let the next
    kernel launch, then wait for the previous one. Nothing may be read or written before it."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
