"""KV write, paged decode attention and varlen prefill attention against their references."""
import pytest
import torch

from kernel_helpers import (
    DEV, DTYPES, INTERPRET, _check, _gen, _lengths, _paged_cache, _randn, _tol, attn_ref, big,
    kernel_test)


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


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_invariant_rows_do_not_depend_on_batch(K, dtype):
    """The batch-invariant variant: each row alone gives bitwise what it gives in the batch
    (the default variant picks its split count from the batch size, so it may not)."""
    b, ctx = big((9, 1500), (3, 70))
    lens = _lengths(b, ctx, 16, 31)
    kc, vc, _, _, tables = _paged_cache(lens, 2, 64, 16, dtype, 32)
    q = _randn((b, 8, 64), dtype, 33)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    full = K.at.decode_attention_invariant(q, kc, vc, tables, sl, 0.125)
    _check(full, attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125), dtype,
           "attention")
    for i in range(b):
        one = K.at.decode_attention_invariant(q[i:i + 1], kc, vc, tables[i:i + 1],
                                              sl[i:i + 1], 0.125)
        assert torch.equal(one, full[i:i + 1]), i


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


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("seqs,hq,hk,d,bs", PREFILL_CASES[:4])
def test_prefill_attention_invariant(K, seqs, hq, hk, d, bs):
    """The batch-invariant prefill: right against the reference (cached prefixes, empty query
    runs), and each token bitwise what decode attention gives it at its position (so KV rebuilt
    after an eviction equals what decoding wrote), alone or in any batch."""
    dtype = torch.bfloat16
    q_lens = [s[0] for s in seqs]
    lens = [s[0] + s[1] for s in seqs]
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, 36)
    t = sum(q_lens)
    q = _randn((t, hq, d), dtype, 37)
    cu_list = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = K.at.prefill_attention_invariant(q, kbad, vbad, cu, sl, tables, scale)
    _check(out, attn_ref.paged_prefill_attention_ref(q, kc, vc, cu, sl, tables, scale), dtype,
           "attention")
    for i, (n, total) in enumerate(zip(q_lens, lens)):
        for j in sorted({0, n // 2, n - 1}) if n else []:
            row = cu_list[i] + j
            pos = torch.tensor([total - n + j + 1], dtype=torch.int32, device=DEV)
            one = K.at.decode_attention_invariant(q[row:row + 1], kbad, vbad, tables[i:i + 1],
                                                  pos, scale)
            assert torch.equal(one, out[row:row + 1]), (i, j)


@kernel_test
@pytest.mark.gpu
def test_prefill_attention_invariant_sequence_does_not_depend_on_batch(K):
    """The batch-invariant variant: a prompt alone gives bitwise what it gives packed with
    others (the default variant sizes its query tiles from the batch's token count)."""
    dtype = torch.bfloat16
    q_lens = big([5, 200, 33], [3, 20, 7])
    kc, vc, _, _, tables = _paged_cache(q_lens, 2, 64, 16, dtype, 34)
    q = _randn((sum(q_lens), 8, 64), dtype, 35)
    cu_list = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    cu = torch.tensor(cu_list, dtype=torch.int32, device=DEV)
    sl = torch.tensor(q_lens, dtype=torch.int32, device=DEV)
    full = K.at.prefill_attention_invariant(q, kc, vc, cu, sl, tables, 0.125)
    _check(full, attn_ref.paged_prefill_attention_ref(q, kc, vc, cu, sl, tables, 0.125), dtype,
           "attention")
    for i, n in enumerate(q_lens):
        rows = slice(cu_list[i], cu_list[i + 1])
        one = K.at.prefill_attention_invariant(
            q[rows], kc, vc, torch.tensor([0, n], dtype=torch.int32, device=DEV), sl[i:i + 1],
            tables[i:i + 1], 0.125)
        assert torch.equal(one, full[rows]), i
