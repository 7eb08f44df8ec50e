"""Triton causal varlen prefill attention over the paged KV cache, and its batch-invariant
variant built on decode attention. PyTorch references: kernels/attention.py. Layout and grids:
kernels/attention_tiles_triton.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_tiles_triton as tiles
from .attention_decode_triton import decode_attention_invariant
from .attention_tiles_triton import LOG2E, attend_tile, dot_operand, ieee_dot, load_kv_tile
from .tuning import DEFAULT, AttentionTuning
from .write_kv_triton import _cache_ok


# N (the number of sequences) changes with every admission batch: specialising on its value
# (== 1, % 16) would JIT-compile a new variant mid-serving, hundreds of ms on the host loop.
@triton.jit(do_not_specialize=["N"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, cu_ptr, sl_ptr, bt_ptr, out_ptr,
                    qk_scale, N, G, D,
                    sq0, sq1, skb, sks, skh, svb, svs, svh, sbt0, so0, so1,
                    BLOCK_SEQ: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, h): query tile `tile` of the packed batch, where each sequence's queries
    are cut into tiles of BLOCK_M starting at its own first query; the program finds its
    sequence by a prefix sum over the per-sequence tile counts. Extra programs do nothing."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kh = (h // G).to(tl.int64)
    h64 = h.to(tl.int64)
    i = tl.arange(0, BLOCK_SEQ)
    imask = i < N
    cs = tl.load(cu_ptr + i, mask=imask, other=0)
    ce = tl.load(cu_ptr + i + 1, mask=imask, other=0)
    ntile = tl.where(imask, tl.cdiv(ce - cs, BLOCK_M), 0)
    cum = tl.cumsum(ntile, 0)
    seq = tl.sum((cum <= tile).to(tl.int32), 0)
    if seq < N:
        first = tl.sum(tl.where(i < seq, ntile, 0), 0)
        mt = tile - first
        q_start = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q_start
        seq_len = tl.load(sl_ptr + seq)
        offset = seq_len - q_len  # cached prefix before the first query

        mrows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        qmask = mrows < q_len
        q_pos = offset + mrows
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        tok = (q_start + mrows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * sq0 + h64 * sq1 + d[None, :],
                    mask=qmask[:, None] & dmask[None, :], other=0.0)
        q = dot_operand(q, k_ptr)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = offset + tl.minimum((mt + 1) * BLOCK_M, q_len)
        kv_end = tl.minimum(kv_end, seq_len)
        bt_row = bt_ptr + seq.to(tl.int64) * sbt0
        n = tl.arange(0, BLOCK_N)
        for n0 in range(0, kv_end, BLOCK_N):
            pos = n0 + n
            kmask = pos < kv_end
            k, v = load_kv_tile(k_ptr, v_ptr, bt_row, pos, kv_end, d, dmask, kh,
                                skb, sks, skh, svb, svs, svh, BLOCK_SIZE)
            ok = kmask[None, :] & (pos[None, :] <= q_pos[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, IEEE,
                                        MAYBE_EMPTY=True)
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)
        tl.store(out_ptr + tok[:, None] * so0 + h64 * so1 + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, *,
                      tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """Causal varlen attention. q: [T, Hq, D] packed; sequence i owns rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], its last tokens (query j at seq_lens[i] - q_len + j)."""
    t, hq, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    n_seq = seq_lens.shape[0]
    out = tiles._new((t, hq, d), q.dtype, q.device)
    if t == 0 or n_seq == 0:
        return out
    if not (_cache_ok(k_cache) and _cache_ok(v_cache)):
        from .attention import paged_prefill_attention_ref
        out.copy_(paged_prefill_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                              block_tables, scale))
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = hq // hk
    block_d = max(16, triton.next_power_of_2(d))
    block_m = tuning.prefill_block_m
    if t < block_m:
        block_m = max(16, triton.next_power_of_2(t))
    ieee = ieee_dot(q.dtype, k_cache.dtype)
    narrow = ieee or block_d > tuning.large_head_dim
    block_n = tuning.prefill_narrow_block_n if narrow else tuning.prefill_block_n
    n_tiles = triton.cdiv(t, block_m) + n_seq  # >= sum_i cdiv(q_len_i, block_m)
    _prefill_kernel[(n_tiles, hq)](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out,
        float(scale) * LOG2E, n_seq, g, d,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SEQ=max(16, triton.next_power_of_2(n_seq)), BLOCK_SIZE=bs, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, IEEE=ieee, num_warps=tuning.prefill_warps,
        num_stages=tuning.prefill_stages)
    return out


def prefill_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float, *,
                                tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """Prefill attention for the batch-invariant kernel set: every query token runs as its own
    row of decode_attention_invariant (its sequence's block table, attending up to its own
    position), the way the speculative verify runs its K+1 positions. A position's attention is
    then computed exactly as when it is decoded, so the KV that a recompute after an eviction
    rebuilds for the output tokens matches the original bit for bit, and a prompt's result does
    not depend on the prefill batch. The price: each token reads its whole prefix (O(T^2) KV
    reads for a T-token prompt) instead of sharing tiles."""
    t, hq, d = q.shape
    out = tiles._new((t, hq, d), q.dtype, q.device)
    n_seq = seq_lens.shape[0]
    if t == 0 or n_seq == 0:
        return out
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    token = torch.arange(t, device=q.device)
    # A captured prefill pads its tokens past cu[-1] (capture/prefill.py), and a mixed step
    # puts its decode rows before cu[0] (capture/mixed.py): they belong to no sequence and
    # attend to one key of the first or last one, so every read stays in bounds.
    seq_of = torch.searchsorted(cu[1:], token, right=True).clamp_(max=n_seq - 1)
    offset = token - cu[seq_of]  # index within its sequence's queries
    lens = seq_lens.long()[seq_of] - q_lens[seq_of] + offset + 1
    lens = torch.where((token >= cu[0]) & (token < cu[-1]), lens, 1).to(torch.int32)
    tables = block_tables[seq_of]
    chunk = tuning.invariant_prefill_chunk  # bounds the split workspaces
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        out[s:e] = decode_attention_invariant(q[s:e], k_cache, v_cache, tables[s:e], lens[s:e],
                                              scale, tuning=tuning)
    return out
