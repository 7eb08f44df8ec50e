"""The bit-level pieces of Triton sampling (kernels/sampling_triton.py): the counter-based
Gumbel noise, bit for bit as kernels/sampling.py computes it, and the ordered packing that lets
one int64 max-reduction return a (value, first index) pair."""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_I64_MIN = tl.constexpr(-9223372036854775807 - 1)  # below every packed pair: "nothing"


# ----------------------------------------------------------------------------------------------
# Bit-exact noise (kernels/sampling.py: hash32, row_key, uniform_noise)


@triton.jit
def _hash32(x):
    """x: uint32 (multiplication wraps mod 2**32, >> is logical)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def _row_key(seed, step):
    """seed, step: int64 scalars -> uint32 key."""
    lo = seed.to(tl.uint32)  # truncation keeps the low 32 bits
    hi = (seed >> 32).to(tl.uint32)
    st = step.to(tl.uint32)
    return _hash32(lo ^ _hash32(hi ^ _hash32(st)))


@triton.jit
def _gumbel(idx, key, PRECISE_LOG: tl.constexpr):
    """idx: int32/int64 vocabulary indices, key: uint32 row key -> fp32 Gumbel noise."""
    x = idx.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32)
    bits = _hash32(_hash32(x ^ key) + key)
    # (bits >> 8) * 2^-24 + 2^-25: exact product, one rounding of the sum, as in float64 -> fp32
    u = (bits >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08 + 2.9802322387695312e-08
    if PRECISE_LOG:  # libdevice logf: what torch's CUDA log computes
        g = -libdevice.log(-libdevice.log(u))
    else:
        g = -tl.log(-tl.log(u))
    return g


# ----------------------------------------------------------------------------------------------
# Ordered packing: one int64 max-reduction gives (max value, smallest index among equals)


@triton.jit
def _okey(f):
    """fp32 -> int32 whose signed order is the float order (-0.0 folded onto +0.0)."""
    i = (f + 0.0).to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _okey_inv(k):
    i = k ^ ((k >> 31) & 0x7FFFFFFF)
    return i.to(tl.float32, bitcast=True)


@triton.jit
def _pack(f, idx):
    return (_okey(f).to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _unpack_val(p):
    return _okey_inv((p >> 32).to(tl.int32))


@triton.jit
def _unpack_idx(p):
    return (0x7FFFFFFF - (p & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _ukey(f):
    """fp32 -> uint32 whose unsigned order is the float order."""
    return (_okey(f) ^ (-2147483647 - 1)).to(tl.uint32, bitcast=True)


@triton.jit
def _ukey_inv(u):
    return _okey_inv(u.to(tl.int32, bitcast=True) ^ (-2147483647 - 1))


@triton.jit
def _row_mode(t, k, p, V):
    """Per-row flags: greedy, top-k on, top-p on."""
    greedy = t <= 0.0
    kon = (k > 0) & (k < V)
    pon = p < 1.0
    return greedy, kon, pon


@triton.jit
def _sort_desc(x):
    return tl.sort(x, 0, descending=True)


if _INTERPRET:
    # The interpreter runs tl.sort as a Python-level bitonic network, seconds per call; the
    # CPU tests use numpy's sort instead (same result: a descending 1-D sort).
    def _sort_desc(x):  # noqa: F811
        import numpy as np
        from triton.runtime.interpreter import TensorHandle

        data = np.ascontiguousarray(np.sort(x.handle.data, kind="stable")[::-1])
        return tl.core.tensor(TensorHandle(data, x.handle.dtype), x.type)
