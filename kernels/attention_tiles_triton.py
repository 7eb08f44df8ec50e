"""What decode and prefill attention over the paged KV cache share
(kernels/attention_decode_triton.py, kernels/attention_prefill_triton.py): loading a tile of
keys and values through the block table, one online-softmax step over it, and the allocation of
every output and workspace.

Same layout and semantics as kernels/attention.py (the references): cache [num_blocks,
block_size, Hk, D]; a sequence's token at position p lives in block block_table[p // block_size],
slot p % block_size. Grids come from tensor shapes only (batch rows, heads, block_tables.shape[1],
total query tokens), never from tensor values, so every launch can be captured in a CUDA graph;
per-row lengths are read on the device and only bound loops.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter computes bf16 tl.dot wrongly; there bf16 operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634  # scores are kept in log2 units: qk_scale includes it


def is_fp8(t: torch.Tensor) -> bool:
    """An fp8 KV cache (kv_cache_dtype="fp8"): written through to_cache, read as any other."""
    return t.dtype == torch.float8_e4m3fn


def ieee_dot(*dtypes: torch.dtype) -> bool:
    return torch.float32 in dtypes or (_INTERPRET and torch.bfloat16 in dtypes)


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output and workspace of the attention modules is allocated here (tests poison it);
    callers reach it through this module so that one patch covers them all."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's element type; an fp8 cache saturates at its largest finite value
    (448) rather than overflowing to NaN, as the reference (kernels/attention.py) does."""
    dtype = cache_ptr.dtype.element_ty
    if dtype.is_fp8():
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(dtype)


@triton.jit
def dot_operand(q, cache_ptr):
    """q in the dtype the tiles' dots run in: its own, or fp16 for bf16 over an fp8 cache. An
    e4m3 pair becomes fp16 in one instruction and bf16 in four (through fp32), and the
    conversions, not the halved bytes, set an fp8 cache's pace. fp16 holds e4m3 and bf16's
    8-bit mantissas exactly; q is clamped to fp16's range, softmax weights lie in [0, 1]."""
    if cache_ptr.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_row, pos, end, d, dmask, kh64, skb, sks, skh, svb, svs, svh,
                 BLOCK_SIZE: tl.constexpr):
    """The keys and values at positions pos (< end) of one KV head, through the block table."""
    kmask = pos < end
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
    slot = (pos % BLOCK_SIZE).to(tl.int64)
    lmask = kmask[:, None] & dmask[None, :]
    k = tl.load(k_ptr + (blk * skb + slot * sks + kh64 * skh)[:, None] + d[None, :],
                mask=lmask, other=0.0)
    v = tl.load(v_ptr + (blk * svb + slot * svs + kh64 * svh)[:, None] + d[None, :],
                mask=lmask, other=0.0)
    return k, v


@triton.jit
def attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr,
                MAYBE_EMPTY: tl.constexpr = False):
    """One online-softmax step over a tile; ok: the [rows or 1, keys] scores that count.
    Decode tiles hold a valid key for every row; MAYBE_EMPTY (causal prefill) allows rows that
    have none yet, whose maximum stays -inf."""
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.where(ok, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if MAYBE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv
