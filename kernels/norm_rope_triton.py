"""Triton RMSNorm (optionally fused with the residual add) and rotary embedding.

They match kernels/rmsnorm.py and kernels/rope.py, rounding points included:
  rms_norm:     y = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype); out = weight * y
  add_rms_norm: summed = (x_f32 + r_f32).to(x.dtype)  (what torch's x + residual does), then rms_norm
  apply_rope:   neox halves, rotation in fp32, result cast back to the input dtype.
Every launch takes its grid from tensor shapes only, so all of them can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .attention_tiles_triton import to_cache
from .tuning import DEFAULT, ElementwiseTuning

_TUNING = DEFAULT.elementwise  # what a caller that passes no table gets


def _new(shape, dtype, device) -> torch.Tensor:
    """Every output of this module is allocated here (tests replace it to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# ----------------------------------------------------------------------------------------------
# RMSNorm


# Row counts follow the token count of each prefill: no value specialisation (see prefill).
@triton.jit(do_not_specialize=["n_rows", "inner"])
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
                     n_rows, inner, D, eps,
                     sx0, sx1, sr0, sr1,
                     HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
    """Rows are the leading dims flattened (up to two of them: [outer, inner, D] with strides
    (s0, s1, 1)); outputs are contiguous [n_rows, D]."""
    pdl.prologue(PDL)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    outer = rows64 // inner
    inn = rows64 % inner
    x_off = outer * sx0 + inn * sx1
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r_off = outer * sr0 + inn * sr1
        r = tl.load(r_ptr + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
        # torch rounds x + residual to the input dtype: fp32 add, one rounding.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows64[:, None] * D + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / D
    rstd = 1.0 / tl.sqrt_rn(ms + eps)
    y = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    # weight * y in the promoted dtype: fp32 product of two narrow floats is exact, so one
    # rounding to the output dtype matches torch's elementwise multiply.
    out = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], out, mask=mask)


def _row_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor with unit last stride, inner, s0, s1) describing rows as [outer, inner]."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 0, 0
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    t = t.reshape(-1, t.shape[-1])
    return t, 1, t.stride(0), 0


def _norm_launch(x, residual, weight, eps, t: ElementwiseTuning):
    d = x.shape[-1]
    n_rows = x.numel() // d if d else 0
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = _new(x.shape, out_dtype, x.device)
    summed = _new(x.shape, x.dtype, x.device) if residual is not None else None
    if n_rows == 0:
        return out, summed
    xv, inner, sx0, sx1 = _row_view(x)
    if residual is not None:
        rv, _, sr0, sr1 = _row_view(residual)  # same shape as x, so the same row split
    else:
        rv, sr0, sr1 = xv, 0, 0
    w = weight.contiguous()
    block_d = triton.next_power_of_2(d)
    # Rows per program from the row width only: a row is then reduced the same way whatever
    # the batch (a batch-invariant norm; small batches just mask part of a tile).
    rows = max(1, min(t.norm_max_rows, t.tile_elements // block_d))
    num_warps = t.norm_wide_warps if block_d >= t.norm_wide_d else t.warps
    grid = (triton.cdiv(n_rows, rows),)
    dependent = pdl.enabled(x)
    _rms_norm_kernel[grid](xv, rv, w, out, summed if summed is not None else out,
                           n_rows, inner, d, float(eps), sx0, sx1, sr0, sr1,
                           HAS_RES=residual is not None, ROWS=rows, BLOCK_D=block_d,
                           PDL=dependent, num_warps=num_warps, launch_pdl=dependent)
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             tuning: ElementwiseTuning = _TUNING) -> torch.Tensor:
    out, _ = _norm_launch(x, None, weight, eps, tuning)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, tuning: ElementwiseTuning = _TUNING
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        # Broadcasting / mixed dtypes: not a shape the model produces; keep the reference.
        from .rmsnorm import add_rms_norm_ref
        return add_rms_norm_ref(x, residual, weight, eps)
    out, summed = _norm_launch(x, residual, weight, eps, tuning)
    return out, summed


# ----------------------------------------------------------------------------------------------
# Rotary embedding


@triton.jit
def rotate_pair(x1, x2, c, s):
    """Neox rotary embedding of the fp32 halves (x1, x2) of head vectors by cos c and sin s.
    Written once: every kernel that rotates (here and the fused decode attention) then writes
    the same bits for the same token."""
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope_rotate(src_ptr, dst_ptr, src_row, s1, dst_row, d1, n_heads, c, s,
                 HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates the n_heads heads at src_ptr + src_row (head stride s1) into dst_ptr + dst_row
    (head stride d1): a contiguous output or a KV-cache slot."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, n_heads, BLOCK_H):
        hh = (h0 + heads).to(tl.int64)
        mask = (hh[:, None] < n_heads) & (cols[None, :] < HALF)
        src = src_ptr + src_row + hh[:, None] * s1 + cols[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rotate_pair(x1, x2, c[None, :], s[None, :])
        dst = dst_ptr + dst_row + hh[:, None] * d1 + cols[None, :]
        tl.store(dst, to_cache(o1, dst_ptr), mask=mask)
        tl.store(dst + HALF, to_cache(o2, dst_ptr), mask=mask)


@triton.jit
def _rope_q(q_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr, t64, HQ, HALF, sq0, sq1, sc0,
            BLOCK_HQ: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates token t64's q heads into qo (contiguous) and returns its cos/sin row for k."""
    pos = tl.load(pos_ptr + t64).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    c = tl.load(cos_ptr + pos * sc0 + cols, mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * sc0 + cols, mask=cmask, other=0.0).to(tl.float32)
    _rope_rotate(q_ptr, qo_ptr, t64 * sq0, sq1, t64 * HQ * 2 * HALF, 2 * HALF, HQ, c, s, HALF,
                 BLOCK_HQ, BLOCK_HALF)
    return c, s


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
                 HQ, HK, HALF, sq0, sq1, sk0, sk1, sc0,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    c, s = _rope_q(q_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr, t64, HQ, HALF, sq0, sq1, sc0,
                   BLOCK_HQ, BLOCK_HALF)
    _rope_rotate(k_ptr, ko_ptr, t64 * sk0, sk1, t64 * HK * 2 * HALF, 2 * HALF, HK, c, s, HALF,
                 BLOCK_HK, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, tuning: ElementwiseTuning = _TUNING
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions [T]; cos/sin [P, D/2] fp32. New tensors out."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_out = _new(q.shape, q.dtype, q.device)
    k_out = _new(k.shape, k.dtype, k.device)
    if t == 0:
        return q_out, k_out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = d // 2
    block_half = triton.next_power_of_2(half)
    cap = max(1, tuning.tile_elements // block_half)
    block_hq = min(triton.next_power_of_2(hq), cap)
    block_hk = min(triton.next_power_of_2(hk), cap)
    _rope_kernel[(t,)](q, k, q_out, k_out, positions, cos, sin, hq, hk, half,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
                       BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
                       num_warps=tuning.warps)
    return q_out, k_out


# ----------------------------------------------------------------------------------------------
# Rotary embedding fused with the KV-cache write


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr,
                          cos_ptr, sin_ptr, HQ, HK, HALF, sq0, sq1, sk0, sk1, sv0, sv1, sc0,
                          skc, skh, svc, svh,
                          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.prologue(PDL)
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    c, s = _rope_q(q_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr, t64, HQ, HALF, sq0, sq1, sc0,
                   BLOCK_HQ, BLOCK_HALF)
    if slot >= 0:  # a negative slot means "no write", as in write_kv
        _rope_rotate(k_ptr, kc_ptr, t64 * sk0, sk1, slot * skc, skh, HK, c, s, HALF,
                     BLOCK_HK, BLOCK_HALF)
        hs = tl.arange(0, BLOCK_HK).to(tl.int64)
        ds = tl.arange(0, BLOCK_D)
        for h0 in range(0, HK, BLOCK_HK):
            h = h0 + hs
            mask = (h[:, None] < HK) & (ds[None, :] < 2 * HALF)
            v = tl.load(v_ptr + t64 * sv0 + h[:, None] * sv1 + ds[None, :], mask=mask)
            tl.store(vc_ptr + slot * svc + h[:, None] * svh + ds[None, :],
                     to_cache(v, vc_ptr), mask=mask)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  tuning: ElementwiseTuning = _TUNING) -> torch.Tensor:
    """apply_rope then write_kv in one launch: returns the rotated q; the rotated k and v go
    straight into their cache slots (no intermediate k tensor)."""
    from .attention_tiles_triton import is_fp8
    from .write_kv_triton import _cache_ok

    t, hq, d = q.shape
    hk = k.shape[1]
    if not (_cache_ok(k_cache) and _cache_ok(v_cache)
            and (k_cache.dtype == k.dtype or is_fp8(k_cache))):
        from .rope import rope_write_kv_ref
        return rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    q_out = _new(q.shape, q.dtype, q.device)
    if t == 0:
        return q_out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    half = d // 2
    block_half = triton.next_power_of_2(half)
    cap = max(1, tuning.tile_elements // block_half)
    block_hq = min(triton.next_power_of_2(hq), cap)
    block_hk = min(triton.next_power_of_2(hk), cap)
    dependent = pdl.enabled(q)
    _rope_write_kv_kernel[(t,)](
        q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos, sin, hq, hk, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
        v_cache.stride(2), BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        BLOCK_D=2 * block_half, PDL=dependent, num_warps=tuning.warps, launch_pdl=dependent)
    return q_out
