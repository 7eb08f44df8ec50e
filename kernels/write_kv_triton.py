"""Triton write_kv: each token's K and V into its flat cache slot (kernels/attention.py
write_kv_ref is the reference). Same cache layout as kernels/attention_tiles_triton.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tiles_triton import to_cache


def _cache_ok(cache: torch.Tensor) -> bool:
    # Slots of a block must be evenly strided so a flat slot index addresses them.
    return cache.stride(-1) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HK, D,
                     sk0, sk1, sv0, sv1, skc, skh, svc, svh,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    if slot >= 0:  # a negative slot means "no write" (the reference would raise)
        for h0 in range(0, HK, BLOCK_H):
            h = (h0 + hs).to(tl.int64)
            mask = (h[:, None] < HK) & (ds[None, :] < D)
            k = tl.load(k_ptr + t * sk0 + h[:, None] * sk1 + ds[None, :], mask=mask)
            v = tl.load(v_ptr + t * sv0 + h[:, None] * sv1 + ds[None, :], mask=mask)
            tl.store(kc_ptr + slot * skc + h[:, None] * skh + ds[None, :],
                     to_cache(k, kc_ptr), mask=mask)
            tl.store(vc_ptr + slot * svc + h[:, None] * svh + ds[None, :],
                     to_cache(v, vc_ptr), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; slot_mapping: [T] flat slot index (block * block_size + offset)."""
    t = k.shape[0]
    if t == 0:
        return
    if not (_cache_ok(k_cache) and _cache_ok(v_cache)):
        from .attention import write_kv_ref
        write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    hk, d = k.shape[1], k.shape[2]
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hk), max(1, 4096 // block_d))
    _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, hk, d,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
                           v_cache.stride(2), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
