"""Merging the splits of flash-decoding (kernels/attention_decode_triton.py): a row's context is cut
into splits whose partial results (running max, sum, accumulator) are combined here by the
split kernel's last program (an atomic ticket per row and KV head, kernels/tickets.py). Same
result as the reference's single softmax over the row (kernels/attention.py)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_normalized(out_ptr, offs, acc, l_i, mask):
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)
    tl.store(out_ptr + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_splits(po_ptr, pm_ptr, pl_ptr, out_ptr, b64, kh64, G, D, NUM_SPLITS, n_split, HK,
                  so0, so1, BLOCK_GR: tl.constexpr, BLOCK_D: tl.constexpr, SC: tl.constexpr):
    """The G heads of (b, kh): out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max m),
    over the row's n_split partials, SC splits at a time. Loads bypass L1 (.cg): the partials
    were written by other SMs during this launch."""
    g = tl.arange(0, BLOCK_GR)
    c = tl.arange(0, SC)
    d = tl.arange(0, BLOCK_D)
    heads = kh64 * G + g
    base = (b64 * (G * HK) + heads) * NUM_SPLITS  # [BLOCK_GR]: split 0 of each head
    gm = g < G
    m_max = tl.full([BLOCK_GR], float("-inf"), tl.float32)
    for s0 in range(0, n_split, SC):
        sm = gm[:, None] & (s0 + c < n_split)[None, :]
        m = tl.load(pm_ptr + base[:, None] + s0 + c[None, :], mask=sm, other=float("-inf"),
                    cache_modifier=".cg")
        m_max = tl.maximum(m_max, tl.max(m, 1))
    total = tl.zeros([BLOCK_GR], tl.float32)
    o = tl.zeros([BLOCK_GR, BLOCK_D], tl.float32)
    for s0 in range(0, n_split, SC):
        sm = gm[:, None] & (s0 + c < n_split)[None, :]
        row = base[:, None] + s0 + c[None, :]  # [BLOCK_GR, SC]
        m = tl.load(pm_ptr + row, mask=sm, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(pl_ptr + row, mask=sm, other=0.0, cache_modifier=".cg")
        w = tl.where(m > float("-inf"), tl.exp2(m - m_max[:, None]), 0.0)  # empty: weigh 0
        acc = tl.load(po_ptr + row[:, :, None] * BLOCK_D + d[None, None, :],
                      mask=sm[:, :, None] & (d < D)[None, None, :], other=0.0,
                      cache_modifier=".cg")
        acc = tl.where(w[:, :, None] > 0, acc, 0.0)
        total += tl.sum(w * l, 1)
        o += tl.sum(acc * w[:, :, None], 1)
    o = tl.where(total[:, None] > 0, o / tl.where(total > 0, total, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b64 * so0 + heads[:, None] * so1 + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & (d < D)[None, :])
