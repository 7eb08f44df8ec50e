"""Triton kernels (kernels/*_triton.py) against their PyTorch references.

The kernel tests are marked `gpu` and run on CUDA (`make test-gpu`). The same tests run on the
CPU through Triton's interpreter: `test_kernels_in_triton_interpreter` (not marked gpu, so part
of the default CPU suite) re-runs this file with TRITON_INTERPRET=1 and
GRAPHEXEC_KERNEL_DEVICE=cpu, under which the tests use CPU tensors and small shapes.

Every output a wrapper allocates is poisoned (NaN / a sentinel) before the kernel runs, and cache
slots the kernels must not read hold NaN, so an unwritten element or a stray read shows up.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from graphexec.kernels import attention as attn_ref
from graphexec.kernels import rmsnorm as norm_ref
from graphexec.kernels import rope as rope_ref
from graphexec.kernels import sampling as samp_ref

CPU_MODE = os.environ.get("GRAPHEXEC_KERNEL_DEVICE", "") == "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


HAS_TRITON = _has_triton()
RUNNABLE = HAS_TRITON and ((CPU_MODE and INTERPRET) or (not CPU_MODE and torch.cuda.is_available()))
DEV = torch.device("cpu" if CPU_MODE else "cuda")

kernel_test = pytest.mark.skipif(
    not RUNNABLE, reason="needs CUDA and Triton, or GRAPHEXEC_KERNEL_DEVICE=cpu + TRITON_INTERPRET=1")
pytestmark = []


def big(gpu_value, cpu_value):
    """Shapes: full size on the GPU, small under the interpreter."""
    return cpu_value if CPU_MODE else gpu_value


# ----------------------------------------------------------------------------------------------
# fixtures and helpers


def _poisoned_empty(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    elif dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-123456789 if dtype in (torch.int32, torch.int64) else 7)
    return t


@pytest.fixture
def K(monkeypatch):
    """The Triton modules, with every output allocation poisoned."""
    from graphexec.kernels import attention_triton, norm_rope_triton, sampling_triton, triton_ops
    for mod in (attention_triton, norm_rope_triton, sampling_triton):
        monkeypatch.setattr(mod, "_new", _poisoned_empty)
    return SimpleNamespace(at=attention_triton, nr=norm_rope_triton, st=sampling_triton,
                           ops=triton_ops.TRITON_OPS)


def _tol(dtype, kind="elementwise"):
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5) if kind == "elementwise" else dict(atol=2e-4, rtol=2e-4)
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3) if kind == "elementwise" else dict(atol=3e-3, rtol=5e-3)
    # bf16: 2 ulp (the interpreter truncates fp32 -> bf16 where the GPU rounds)
    return dict(atol=2e-2, rtol=2e-2) if kind == "elementwise" else dict(atol=2e-2, rtol=2e-2)


def _check(out, ref, dtype, kind="elementwise"):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert not torch.isnan(out).any(), "NaN in output: an element left unwritten or a bad read"
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype, kind))


def _gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(device=DEV, dtype=dtype)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]

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
    out, summed = K.ops.add_rms_norm(x, r, w, 1e-6)
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
    q2, k2 = K.ops.apply_rope(q, k, pos, cos, sin)
    rq, rk = rope_ref.apply_rope_ref(q, k, pos, cos, sin)
    _check(q2, rq, dtype)
    _check(k2, rk, dtype)


# ----------------------------------------------------------------------------------------------
# Paged KV cache helpers


def _paged_cache(seq_lens, hk, d, block_size, dtype, seed, extra_cols=1):
    """Returns (clean_k, clean_v, poisoned_k, poisoned_v, block_tables). Each sequence gets
    distinct random blocks; slots past its length and the blocks that table columns beyond the
    sequence point to hold NaN in the poisoned caches and zeros in the clean ones."""
    n_blocks_seq = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    used = sum(n_blocks_seq)
    spare = 3
    nb = used + spare
    g = _gen(seed)
    perm = torch.randperm(used, generator=g)
    m = max(n_blocks_seq) + extra_cols
    tables = torch.empty(len(seq_lens), m, dtype=torch.int32)
    k_clean = torch.zeros(nb, block_size, hk, d)
    v_clean = torch.zeros(nb, block_size, hk, d)
    k_bad = torch.full((nb, block_size, hk, d), float("nan"))
    v_bad = torch.full((nb, block_size, hk, d), float("nan"))
    at = 0
    for i, s in enumerate(seq_lens):
        blocks = perm[at:at + n_blocks_seq[i]]
        at += n_blocks_seq[i]
        tables[i, :len(blocks)] = blocks.int()
        tables[i, len(blocks):] = torch.randint(used, nb, (m - len(blocks),), generator=g).int()
        for j, blk in enumerate(blocks.tolist()):
            n = min(block_size, s - j * block_size)
            if n <= 0:
                continue
            kk = torch.randn(n, hk, d, generator=g)
            vv = torch.randn(n, hk, d, generator=g)
            k_clean[blk, :n] = kk
            v_clean[blk, :n] = vv
            k_bad[blk, :n] = kk
            v_bad[blk, :n] = vv
    cast = dict(device=DEV, dtype=dtype)
    return (k_clean.to(**cast), v_clean.to(**cast), k_bad.to(**cast), v_bad.to(**cast),
            tables.to(DEV))


def _lengths(b, max_len, block_size, seed):
    """b lengths in [1, max_len]: 1, max_len, block boundaries +-1, random."""
    g = _gen(seed)
    special = [1, max_len, block_size, block_size + 1, 2 * block_size - 1, max_len - 1]
    out = []
    for i in range(b):
        if i < len(special):
            v = special[i]
        else:
            v = int(torch.randint(1, max_len + 1, (1,), generator=g))
        out.append(min(max(v, 1), max_len))
    return out


# ----------------------------------------------------------------------------------------------
# write_kv


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hk,d,bs", big([(1, 8, 128, 16), (64, 8, 128, 16), (300, 2, 64, 32),
                                           (17, 1, 32, 16)],
                                          [(1, 2, 32, 16), (7, 2, 64, 8)]))
@pytest.mark.parametrize("src_dtype", ["same", "fp32"])
def test_write_kv(K, dtype, t, hk, d, bs, src_dtype):
    nb = t // bs + 4
    slots = torch.randperm(nb * bs, generator=_gen(10))[:t].to(DEV)
    sd = dtype if src_dtype == "same" else torch.float32
    # k as a strided view (a slice of a fused projection), v contiguous
    kv = _randn((t, 2 * hk * d), sd, 11)
    k = kv[:, :hk * d].reshape(t, hk, d)
    v = _randn((t, hk, d), sd, 12)
    kc = torch.full((nb, bs, hk, d), float("nan"), device=DEV, dtype=dtype)
    vc = torch.full((nb, bs, hk, d), float("nan"), device=DEV, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    K.ops.write_kv(kc, vc, k, v, slots)
    attn_ref.write_kv_ref(kr, vr, k, v, slots)
    # written slots equal, untouched ones still NaN
    assert torch.equal(torch.isnan(kc), torch.isnan(kr))
    assert torch.equal(torch.isnan(vc), torch.isnan(vr))
    if sd == dtype or not INTERPRET:
        assert torch.equal(kc.nan_to_num(0.0), kr.nan_to_num(0.0))
        assert torch.equal(vc.nan_to_num(0.0), vr.nan_to_num(0.0))
    else:  # the interpreter truncates fp32 -> bf16 instead of rounding
        torch.testing.assert_close(kc.nan_to_num(0.0), kr.nan_to_num(0.0), **_tol(dtype))
        torch.testing.assert_close(vc.nan_to_num(0.0), vr.nan_to_num(0.0), **_tol(dtype))


# ----------------------------------------------------------------------------------------------
# decode attention

# (batch, max context, q heads, kv heads, head dim, block size, forced splits or None)
DECODE_CASES = big(
    [
        (1, 1, 32, 8, 128, 16, None),
        (3, 37, 8, 2, 64, 16, None),
        (64, 2048, 32, 8, 128, 16, None),
        (64, 2048, 32, 8, 128, 16, 7),
        (4, 8192, 32, 8, 128, 16, None),
        (2, 8192, 8, 8, 64, 16, 64),
        (256, 96, 16, 2, 64, 16, None),
        (256, 200, 8, 1, 128, 16, 3),
        (16, 1000, 16, 16, 128, 32, None),
        (5, 300, 4, 2, 32, 16, 4),
        (7, 513, 64, 8, 128, 16, 2),
    ],
    [
        (1, 1, 4, 2, 32, 16, None),
        (3, 37, 8, 2, 64, 16, None),
        (4, 70, 4, 4, 32, 16, 3),
        (2, 50, 8, 1, 64, 8, 1),
    ])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,ctx,hq,hk,d,bs,splits", DECODE_CASES)
def test_decode_attention(K, dtype, b, ctx, hq, hk, d, bs, splits):
    lens = _lengths(b, ctx, bs, 20 + b)
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, 21)
    q = _randn((b, hq, d), dtype, 22)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale)
    if splits is None:
        out = K.ops.decode_attention(q, kbad, vbad, tables, seq_lens, scale)
    else:
        out = K.at.decode_attention_splits(q, kbad, vbad, tables, seq_lens, scale, splits)
    _check(out, ref, dtype, "attention")


@kernel_test
@pytest.mark.gpu
def test_decode_attention_many_splits_short_rows(K):
    """More splits than a row has tiles: the empty splits must contribute nothing."""
    dtype = torch.float16
    lens = [1, 2, 64, 65]
    kc, vc, kbad, vbad, tables = _paged_cache(lens, 2, 64, 16, dtype, 23, extra_cols=8)
    q = _randn((4, 8, 64), dtype, 24)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125)
    for splits in (1, 2, 5, 12):
        out = K.at.decode_attention_splits(q, kbad, vbad, tables, sl, 0.125, splits)
        _check(out, ref, dtype, "attention")


# ----------------------------------------------------------------------------------------------
# prefill attention

# (list of (query tokens, cached prefix) per sequence, q heads, kv heads, head dim, block size)
PREFILL_CASES = big(
    [
        ([(1, 0)], 32, 8, 128, 16),
        ([(17, 0), (5, 30), (0, 3), (64, 64), (130, 7)], 8, 2, 64, 16),
        ([(512, 0), (300, 1000), (1, 2047), (77, 0)], 32, 8, 128, 16),
        ([(40, 0)] * 9, 16, 16, 64, 16),
        ([(1000, 3000)], 32, 4, 128, 16),
        ([(3, 0), (200, 13), (64, 0)], 14, 2, 64, 32),
        ([(33, 5), (16, 16)], 4, 2, 32, 16),
    ],
    [
        ([(1, 0)], 4, 2, 32, 16),
        ([(17, 0), (5, 30), (0, 3), (20, 16)], 8, 2, 64, 16),
        ([(9, 4), (3, 0)], 4, 4, 32, 8),
    ])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,hq,hk,d,bs", PREFILL_CASES)
def test_prefill_attention(K, dtype, seqs, hq, hk, d, bs):
    q_lens = [s[0] for s in seqs]
    lens = [s[0] + s[1] for s in seqs]
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, 30)
    t = sum(q_lens)
    q = _randn((t, hq, d), dtype, 31)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    ref = attn_ref.paged_prefill_attention_ref(q, kc, vc, cu, sl, tables, scale)
    out = K.ops.prefill_attention(q, kbad, vbad, cu, sl, tables, scale)
    _check(out, ref, dtype, "attention")


# ----------------------------------------------------------------------------------------------
# sampling

# One row per mode: (temperature, top_k, top_p, logit scale)
SAMPLE_MODES = [
    (0.0, 0, 1.0, 3.0),     # greedy
    (1.0, 0, 1.0, 3.0),     # plain sampling
    (0.7, 0, 1.0, 1.0),
    (1.0, 1, 1.0, 3.0),     # top-1
    (0.8, 5, 1.0, 3.0),     # small top-k
    (1.0, 50, 0.9, 3.0),    # top-k and top-p
    (1.3, 0, 0.8, 3.0),     # top-p on a peaked row
    (1.0, 0, 0.9, 0.2),     # top-p on a flat row
    (1.0, 0, 0.0, 1.0),     # top-p 0: the max only
    (1.0, -1, 0.5, 2.0),    # negative top-k: off
    (0.5, 10**9, 0.95, 2.0),  # top-k beyond V: off
    (1.0, 700, 1.0, 0.5),   # large top-k
    (2.0, 3000, 0.97, 1.0),  # top-k beyond the selection table
    (0.9, 40, 0.3, 0.05),   # almost tied logits
]


def _sample_inputs(b, v, seed, modes=SAMPLE_MODES, neg_inf=True):
    g = _gen(seed)
    logits = torch.randn(b, v, generator=g)
    temps, ks, ps = [], [], []
    for i in range(b):
        t, k, p, scale = modes[i % len(modes)]
        logits[i] *= scale
        temps.append(t)
        ks.append(min(k, 2**62))
        ps.append(p)
    if neg_inf and v > 8:  # stop tokens masked by mask_stop_tokens
        logits[1::3, 3] = float("-inf")
        logits[2::5, :5] = float("-inf")
    seeds = torch.randint(-2**63, 2**63 - 1, (b,), generator=g, dtype=torch.int64)
    steps = torch.randint(0, 2**40, (b,), generator=g, dtype=torch.int64)
    cast = dict(device=DEV)
    return (logits.to(**cast), torch.tensor(temps, **cast), torch.tensor(ks, **cast),
            torch.tensor(ps, **cast), seeds.to(**cast), steps.to(**cast))


SAMPLE_SIZES = big([(14, 16), (28, 1000), (64, 32000), (64, 128256), (3, 151936), (256, 500)],
                   [(14, 16), (28, 300)])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("b,v", SAMPLE_SIZES)
def test_sample_matches_reference(K, b, v):
    args = _sample_inputs(b, v, 40 + v)
    ref = samp_ref.sample_ref(*args)
    out = K.ops.sample(*args)
    assert out.dtype == torch.int64 and out.shape == (b,)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("v,knobs", big(
    [(5000, dict(chunk=512, sub=128, top_r=2, cap=256, small_cap=64)),
     (128256, dict()),
     (40000, dict(chunk=1024, sub=256, top_r=1, cap=512, small_cap=128, fb_block=512))],
    [(1200, dict(chunk=128, sub=32, top_r=1, cap=128, small_cap=32, scan=16, fb_block=128))]))
def test_sample_every_path(K, v, knobs):
    """Shrunk knobs send rows down every path: greedy, unfiltered, the two candidate sorts and
    the exact fallback; all must give the reference's token."""
    st = K.st
    chunk, sub = knobs.get("chunk", st.CHUNK), knobs.get("sub", st.SUB)
    top_r = knobs.get("top_r", st.TOP_R)
    small, cap = knobs.get("small_cap", st.SMALL_CAP), knobs.get("cap", st.CAP)
    table = math.ceil(v / chunk) * (chunk // sub) * top_r
    k_full = (small + min(table, cap)) // 2  # candidates between the two sort sizes
    modes = SAMPLE_MODES + [(1.0, k_full, 1.0, 3.0), (1.0, k_full, 0.99, 3.0),
                            (1.0, 100, 0.99, 3.0)]
    b = len(modes) + big(len(modes), 0)
    args = _sample_inputs(b, v, 50, modes=modes)
    path = torch.full((b,), -1, dtype=torch.int32, device=DEV)
    out = K.st.sample_impl(*args, path=path, **knobs)
    ref = samp_ref.sample_ref(*args)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist(), path.tolist())
    seen = set(path.tolist())
    assert -1 not in seen
    assert seen >= {0, 1, 2, 3, 4}, seen


@kernel_test
@pytest.mark.gpu
def test_sample_batch_invariance(K):
    """A (seed, step) row gives the same token wherever it sits and whatever the batch."""
    v = big(50000, 300)
    logits, temps, ks, ps, seeds, steps = _sample_inputs(14, v, 60)
    full = K.ops.sample(logits, temps, ks, ps, seeds, steps)
    perm = torch.randperm(14, generator=_gen(61)).to(DEV)
    permuted = K.ops.sample(logits[perm], temps[perm], ks[perm], ps[perm], seeds[perm],
                            steps[perm])
    assert torch.equal(permuted, full[perm])
    for i in (0, 5, 13):
        one = K.ops.sample(logits[i:i + 1], temps[i:i + 1], ks[i:i + 1], ps[i:i + 1],
                           seeds[i:i + 1], steps[i:i + 1])
        assert one.item() == full[i].item()
    # a different step gives (almost surely) a different token for a flat sampled row
    flat = torch.zeros(1, v, device=DEV)
    one = torch.ones(1, device=DEV)
    toks = {K.ops.sample(flat, one, torch.zeros(1, dtype=torch.int64, device=DEV), one,
                         seeds[:1], torch.tensor([s], device=DEV)).item() for s in range(8)}
    assert len(toks) > 1


@kernel_test
@pytest.mark.gpu
def test_sample_greedy_ties_first_index(K):
    v = big(70000, 200)
    logits = torch.zeros(3, v, device=DEV)
    logits[0, [7, 9, v - 1]] = 5.0
    logits[1, [v - 2, v - 1]] = 1.0
    logits[2] = -1.0
    z = torch.zeros(3, device=DEV)
    out = K.ops.sample(logits, z, torch.zeros(3, dtype=torch.int64, device=DEV),
                       torch.ones(3, device=DEV), torch.zeros(3, dtype=torch.int64, device=DEV),
                       torch.zeros(3, dtype=torch.int64, device=DEV))
    assert out.tolist() == [7, v - 2, 0]


def _chi2_critical(df: int, alpha: float = 1e-3) -> float:
    try:
        from scipy.stats import chi2
        return float(chi2.ppf(1 - alpha, df))
    except Exception:  # Wilson-Hilferty, z(0.999) = 3.0902
        z = 3.0902
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("temp,top_k,top_p", big([(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                  (1.0, 8, 0.9), (2.0, 0, 0.5)],
                                                 [(0.7, 5, 1.0), (1.0, 0, 0.7)]))
def test_sample_distribution(K, temp, top_k, top_p):
    """Draws over distinct steps follow softmax(logits / T) restricted to the kept set."""
    v = 16
    n = big(40000, 300)  # the interpreter runs ~30 ms per row
    g = _gen(70)
    row = torch.randn(v, generator=g) * 1.5
    row[3] = row[4]  # a tie
    logits = row[None, :].expand(n, v).contiguous().to(DEV)
    temps = torch.full((n,), temp, device=DEV)
    ks = torch.full((n,), top_k, dtype=torch.int64, device=DEV)
    ps = torch.full((n,), top_p, device=DEV)
    seeds = torch.full((n,), 12345, dtype=torch.int64, device=DEV)
    steps = torch.arange(n, dtype=torch.int64, device=DEV)
    if CPU_MODE:  # small blocks: the interpreter's time goes with their sizes
        toks = K.st.sample_impl(logits, temps, ks, ps, seeds, steps, chunk=16, sub=16, cap=16,
                                small_cap=16, scan=16)
    else:
        toks = K.ops.sample(logits, temps, ks, ps, seeds, steps)
    toks = toks.cpu()
    scaled = (row / temp)[None, :]
    keep = samp_ref.topk_topp_mask(scaled, torch.tensor([top_k]), torch.tensor([top_p]))[0]
    probs = torch.softmax(scaled[0].masked_fill(~keep, float("-inf")), dim=-1).double()
    counts = torch.bincount(toks, minlength=v).double()
    assert counts[~keep].sum() == 0, "a masked token was drawn"
    exp = probs * n
    # merge cells expected below 5 into one
    small = (exp < 5) & keep
    cells_o = counts[keep & ~small].tolist()
    cells_e = exp[keep & ~small].tolist()
    if small.any():
        cells_o.append(float(counts[small].sum()))
        cells_e.append(float(exp[small].sum()))
    if len(cells_e) < 2:
        assert counts[keep].sum() == n
        return
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    assert stat < _chi2_critical(len(cells_e) - 1), (stat, cells_o, cells_e)


@kernel_test
@pytest.mark.gpu
def test_ops_table(K):
    from graphexec.kernels import REFERENCE_OPS
    assert K.ops.name == "triton"
    assert K.ops.mask_stop_tokens is REFERENCE_OPS.mask_stop_tokens
    assert K.ops.logprobs is REFERENCE_OPS.logprobs


# ----------------------------------------------------------------------------------------------
# CUDA graphs (real GPU only)


@pytest.mark.gpu
@pytest.mark.skipif(CPU_MODE or not RUNNABLE, reason="needs CUDA")
def test_cuda_graph_capture_and_replay(K):
    """Decode attention and sampling captured once, replayed after the device inputs change
    (longer contexts, other seeds/steps): the replays match fresh reference calls."""
    dtype = torch.bfloat16
    b, hq, hk, d, bs = 8, 8, 2, 64, 16
    lens = [5, 40, 100, 16, 17, 1, 63, 200]
    kc, vc, _, _, tables = _paged_cache([300] * b, hk, d, bs, dtype, 80)
    q = _randn((b, hq, d), dtype, 81)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    logits, temps, ks, ps, seeds, steps = _sample_inputs(b, 1000, 82)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles) outside the capture
            K.ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5)
            K.ops.sample(logits, temps, ks, ps, seeds, steps)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5)
        tok = K.ops.sample(logits, temps, ks, ps, seeds, steps)
    for it in range(3):
        sl.add_(it * 7)
        steps.add_(1)
        q.copy_(_randn((b, hq, d), dtype, 90 + it))
        logits.copy_(_sample_inputs(b, 1000, 95 + it)[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, d ** -0.5)
        _check(out, ref, dtype, "attention")
        assert torch.equal(tok, samp_ref.sample_ref(logits, temps, ks, ps, seeds, steps))


# ----------------------------------------------------------------------------------------------
# The interpreter run (CPU)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CPU_MODE, reason="already running under the interpreter")
def test_kernels_in_triton_interpreter():
    """Runs this file's kernel tests on the CPU through TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", GRAPHEXEC_KERNEL_DEVICE="cpu",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-m", "gpu", "-q", "-x",
           "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tail = (res.stdout[-6000:] + "\n" + res.stderr[-3000:])
    assert res.returncode == 0, tail
    assert " passed" in res.stdout, tail
