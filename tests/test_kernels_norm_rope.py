"""Fused residual-add + RMSNorm and rotary embedding kernels against their references."""
import pytest
import torch

from kernel_helpers import (
    DEV, DTYPES, _check, _gen, _randn, big, kernel_test, norm_ref, rope_ref)


# ----------------------------------------------------------------------------------------------
# RMSNorm

NORM_SHAPES = big([(1, 64), (5, 4096), (64, 4096), (3, 5000), (256, 2048)],
                  [(1, 64), (3, 300), (4, 128)])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(K, dtype, shape):
    x = _randn(shape, dtype, 1, 2.0)
    w = _randn(shape[-1:], dtype, 2) + 1
    _check(K.ops.rms_norm(x, w, 1e-5), norm_ref.rms_norm_ref(x, w, 1e-5), dtype)
    r = _randn(shape, dtype, 3)
    out, summed = K.nr.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_sum = norm_ref.add_rms_norm_ref(x, r, w, 1e-6)
    _check(summed, ref_sum, dtype)
    _check(out, ref_out, dtype)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", big([(1, 32, 8, 128), (7, 16, 2, 64), (33, 4, 4, 32)],
                                           [(3, 4, 2, 32), (2, 2, 1, 64)]))
def test_rms_norm_heads(K, dtype, t, hq, hk, d):
    """Qwen3's per-head norm: [T, heads, D] views cut out of a fused qkv projection."""
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, 4, 3.0)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q = q.reshape(t, hq, d)
    k = k.reshape(t, hk, d)
    assert t == 1 or not q.is_contiguous()
    w = _randn((d,), dtype, 5) + 1
    _check(K.ops.rms_norm(q, w, 1e-6), norm_ref.rms_norm_ref(q, w, 1e-6), dtype)
    _check(K.ops.rms_norm(k, w, 1e-6), norm_ref.rms_norm_ref(k, w, 1e-6), dtype)


@kernel_test
@pytest.mark.gpu
def test_rms_norm_weight_promotion(K):
    x = _randn((3, 128), torch.bfloat16, 6)
    w = _randn((128,), torch.float32, 7)
    _check(K.ops.rms_norm(x, w, 1e-5), norm_ref.rms_norm_ref(x, w, 1e-5), torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# RoPE


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d", big([(1, 32, 8, 128), (64, 32, 8, 128), (5, 14, 2, 64),
                                           (9, 4, 2, 32)],
                                          [(1, 4, 2, 32), (5, 6, 2, 64)]))
def test_rope(K, dtype, t, hq, hk, d):
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, 8)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q = q.reshape(t, hq, d)
    k = k.reshape(t, hk, d)
    cos, sin = rope_ref.rope_cos_sin(4096, d, 500000.0, device=DEV)
    pos = torch.randint(0, 4096, (t,), generator=_gen(9)).to(DEV)
    q2, k2 = K.nr.apply_rope(q, k, pos, cos, sin)
    rq, rk = rope_ref.apply_rope_ref(q, k, pos, cos, sin)
    _check(q2, rq, dtype)
    _check(k2, rk, dtype)
