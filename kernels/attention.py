"""Attention over the paged KV cache: PyTorch references (the CPU path and the test oracle).

Cache layout, per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A sequence's token at position p lives in block block_table[p // block_size], slot
p % block_size. Every function reads its sizes from tensors, never from host scalars, so the same
call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from .row_vectors import check_dense

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def to_cache_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a cache of `dtype`: an fp8 cache (kv_cache_dtype="fp8") saturates at 448, where a
    plain cast would give NaN. Reading converts back exactly (the readers upcast)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; slot_mapping: [T] flat slot index (block * block_size + offset)."""
    check_dense(slot_mapping)
    for cache, x in ((k_cache, k), (v_cache, v)):
        nb, bs, hk, d = cache.shape
        x = to_cache_ref(x, cache.dtype)
        if cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(nb * bs, hk, d).index_copy_(0, slot_mapping, x)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., M] block ids -> [..., M * block_size, Hk, D]."""
    g = cache[block_table]
    return g.reshape(*block_table.shape[:-1], -1, cache.shape[2], cache.shape[3])


def _columns_in_use(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """On the CPU, only the block-table columns the longest row reaches: the graph-safe fixed
    width (every column up to the context limit) is for CUDA, and gathering and scoring it
    whole made a CPU decode step cost the context limit, not the rows' lengths. Reading the
    lengths is free there; on CUDA it would be a sync, so the table stays whole."""
    if seq_lens.device.type != "cpu" or seq_lens.numel() == 0:
        return block_tables
    cols = max(1, -(-int(seq_lens.max()) // block_size))
    return block_tables[..., :cols]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, split_rows: int | None = None) -> torch.Tensor:
    """One query per row. q: [B, Hq, D]; block_tables: [B, M]; seq_lens: [B] (keys to attend,
    the query's own position included). Returns [B, Hq, D] in q's dtype; fp32 accumulation.
    split_rows: a hint for kernels that split a row's keys (unused here)."""
    check_dense(seq_lens)
    b, hq, d = q.shape
    hk = k_cache.shape[2]
    block_tables = _columns_in_use(block_tables, seq_lens, k_cache.shape[1])
    keys = _gather_context(k_cache, block_tables).float()  # [B, L, Hk, D]
    vals = _gather_context(v_cache, block_tables).float()
    qg = q.float().view(b, hk, hq // hk, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) * scale
    pos = torch.arange(keys.shape[1], device=q.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Past a row's length the gathered blocks hold anything (the scratch block takes padding's
    # writes, NaN included), and a zero weight times NaN is NaN: those values must not enter.
    vals = vals.masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("bhgl,blhd->bhgd", probs, vals)
    return out.reshape(b, hq, d).to(q.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal varlen attention. q: [T, Hq, D] packed; sequence i owns q rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1], which are its *last* tokens: with q_len queries and
    seq_lens[i] keys, query j sits at position seq_lens[i] - q_len + j (a cached prefix before the
    queries needs no new kernel). Loops over sequences: this is the reference, not the fast path.
    Tokens of no sequence (a padded batch's) get zeros."""
    check_dense(cu_seqlens_q, seq_lens)
    out = torch.zeros_like(q)
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for i in range(len(lens)):
        s, e, n_keys = starts[i], starts[i + 1], lens[i]
        n_q = e - s
        if n_q == 0:
            continue
        n_blocks = -(-n_keys // k_cache.shape[1])
        table = block_tables[i, :n_blocks]  # the blocks it reaches
        keys = _gather_context(k_cache, table)[:n_keys].float()  # [L, Hk, D]
        vals = _gather_context(v_cache, table)[:n_keys].float()
        qi = q[s:e].float().view(n_q, hk, hq // hk, d)
        scores = torch.einsum("qhgd,lhd->hgql", qi, keys) * scale
        q_pos = torch.arange(n_keys - n_q, n_keys, device=q.device)
        k_pos = torch.arange(n_keys, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgql,lhd->qhgd", probs, vals)
        out[s:e] = o.reshape(n_q, hq, d).to(q.dtype)
    return out


def rope_decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float,
                              split_rows: int | None = None) -> torch.Tensor:
    """A decode step's attention as one op: rotate q and k, write k and v to their slots, attend.
    Every row must be a different sequence (a row never reads another row's new token), which
    lets a kernel write and read a row's new token in the same program; the speculative verify,
    whose rows share sequences, calls the two ops instead. split_rows: unused here (as
    paged_decode_attention_ref)."""
    from .rope import rope_write_kv_ref

    q = rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
