"""KV write, paged decode attention and varlen prefill attention against their references."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kernel_helpers import (
    DEV, DTYPES, INTERPRET, _check, _gen, _lengths, _paged_cache, _randn, _tol, attn_ref, big,
    kernel_test, rope_ref)
from graphexec.kernels.tickets import ticket_counters


# write_kv


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hk,d,bs", big([(1, 8, 128, 16), (64, 8, 128, 16), (300, 2, 64, 32),
                                           (17, 1, 32, 16)],
                                          [(1, 2, 32, 16), (7, 2, 64, 8)]))
@pytest.mark.parametrize("src_dtype", ["same", "fp32"])
def test_write_kv(K, dtype, t, hk, d, bs, src_dtype):
    from graphexec.kernels.write_kv_triton import write_kv

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
    write_kv(kc, vc, k, v, slots)
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
def test_decode_attention_splits_as_hinted(K):
    """split_rows (a mixed step's decode part: capture/mixed.py) sizes the split count as for a
    batch of that many rows: more splits for 64 rows than their own count gives, the same
    result as the reference either way."""
    dtype = torch.bfloat16
    b, hq, hk, d, bs = 64, 8, 2, 64, 16
    lens = [1] * (b - 2) + [700, 300]  # two live rows among inert places
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, 25)
    q = _randn((b, hq, d), dtype, 26)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125, split_rows=2)
    m = tables.shape[1]
    block_n = K.at._decode_blocks(d, b)[1]
    # splits by the wave count alone (the interpreter's 8 "SMs" are filled by 64 rows)
    t = replace(K.at.DEFAULT.attention, long_split_tiles=0)
    own = K.at._decode_num_splits(b, hk, m, bs, block_n, q.device, t)
    hinted = K.at._decode_num_splits(2, hk, m, bs, block_n, q.device, t)
    assert hinted > own
    for hint in (None, 2):
        out = K.at.decode_attention(q, kbad, vbad, tables, sl, 0.125, split_rows=hint, tuning=t)
        _check(out, ref, dtype, "attention")


@kernel_test
@pytest.mark.gpu
def test_decode_attention_splits_long_rows_where_rows_fill_the_gpu(K):
    """A program per (row, KV head) fills the GPU: only long rows split, in runs of
    long_split_tiles tiles (serving's mix of short and long contexts), matching the
    reference with the counters back at zero."""
    t = K.at.DEFAULT.attention
    dtype = torch.bfloat16
    b, hk, d, bs = big(72, 8), 2, 64, 16
    lens = [33] * (b - 3) + [1000, 2049, 513]
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, 27)
    q = _randn((b, 4 * hk, d), dtype, 28)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    block_n = K.at._decode_blocks(d, b)[1]
    max_tiles = -(-tables.shape[1] * bs // block_n)
    assert K.at._decode_min_tiles(b, hk, q.device) == t.long_split_tiles > 1
    assert K.at._decode_num_splits(b, hk, tables.shape[1], bs, block_n, q.device) == min(
        -(-max_tiles // t.long_split_tiles), t.long_max_splits) > 1
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125)
    _check(K.at.decode_attention(q, kbad, vbad, tables, sl, 0.125), ref, dtype, "attention")
    assert int(ticket_counters(q.device, 1).abs().sum()) == 0


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
def test_decode_attention_split_merge_leaves_counters_zero_and_is_deterministic(K):
    """Several splits merge inside the kernel: the program with the last ticket of its (row,
    KV head) merges and resets the counter. Counters must be zero after every launch (a graph
    replays the same buffer), and the result must not depend on which program ended last:
    repeated launches are bitwise equal and match the reference. Rows of 1 to many tiles,
    min_tiles 1, 2 and 4."""
    dtype = torch.bfloat16
    lens = big([1, 64, 65, 300, 1000, 2049], [1, 64, 65, 200])
    kc, vc, _, _, tables = _paged_cache(lens, 2, 64, 16, dtype, 25, extra_cols=4)
    q = _randn((len(lens), 8, 64), dtype, 26)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125)
    for min_tiles in (1, 2, 4):
        first = K.at.decode_attention_splits(q, kc, vc, tables, sl, 0.125, 8, min_tiles=min_tiles)
        _check(first, ref, dtype, "attention")
        counters = ticket_counters(q.device, 1)
        assert int(counters.abs().sum()) == 0, min_tiles
        for _ in range(3):
            again = K.at.decode_attention_splits(q, kc, vc, tables, sl, 0.125, 8,
                                                 min_tiles=min_tiles)
            assert torch.equal(again, first), min_tiles
        assert int(counters.abs().sum()) == 0, min_tiles


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


def _rope_decode_inputs(dtype, b, ctx, hq, hk, d, bs, seed, no_write_row=None, offsets=None,
                        guard=False):
    """Raw (unrotated) q, k, v as views of one packed qkv tensor, as the model passes them; a
    paged cache whose slot for each row's new token holds NaN in the poisoned copy, so a
    missing write shows; and the reference's result and caches. The new token sits at
    position len - 1 + offsets[i] (0 by default: a decode step; negative: inside the context,
    positive: past it, unread), in the slot the row's block table gives that position.
    guard: the poisoned caches are views behind a guard block of 7s (cache[-1] is the guard),
    so a write to a negative slot shows."""
    from graphexec.kernels.rope import rope_cos_sin

    lens = _lengths(b, ctx, bs, seed)
    kc, vc, kbad, vbad, tables = _paged_cache(lens, hk, d, bs, dtype, seed + 1)
    if guard:
        wall = torch.full((1,) + tuple(kbad.shape[1:]), 7.0, dtype=dtype, device=DEV)
        kbad, vbad = torch.cat([wall, kbad])[1:], torch.cat([wall, vbad])[1:]
    qkv = _randn((b, (hq + 2 * hk) * d), dtype, seed + 2)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hk, d), v.view(b, hk, d)
    offsets = offsets or [0] * b
    pos = torch.tensor([n - 1 + o for n, o in zip(lens, offsets)], device=DEV)
    slots = torch.stack([tables[i, p // bs].long() * bs + p % bs
                         for i, p in enumerate(pos.tolist())])
    for i in range(b):
        if i != no_write_row:
            blk, off = divmod(int(slots[i]), bs)
            kbad[blk, off] = float("nan")
            vbad[blk, off] = float("nan")
    cos, sin = rope_cos_sin(ctx + 8, d, 10000.0, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kref, vref = kc.clone(), vc.clone()
    write = [i for i in range(b) if i != no_write_row]
    q_rot = rope_ref.rope_write_kv_ref(q[write], k[write], v[write], pos[write], cos, sin,
                                       kref, vref, slots[write])
    q_all = rope_ref.apply_rope_ref(q, k, pos, cos, sin)[0]
    q_all[write] = q_rot
    ref = attn_ref.paged_decode_attention_ref(q_all, kref, vref, tables, seq_lens, d ** -0.5)
    if no_write_row is not None:
        slots[no_write_row] = -1
    return SimpleNamespace(q=q, k=k, v=v, pos=pos, cos=cos, sin=sin, kbad=kbad, vbad=vbad,
                           slots=slots, tables=tables, seq_lens=seq_lens, scale=d ** -0.5,
                           ref=ref, kref=kref, vref=vref)


def _check_cache_writes(x, dtype, slots):
    """The rows' new K/V landed in `slots` (no NaN left, the reference's values) and every
    other slot kept its bits."""
    for got, want in ((x.kbad, x.kref), (x.vbad, x.vref)):
        written = got.flatten(0, 1)[slots]
        assert not torch.isnan(written).any(), "a row's new K/V was not written"
        torch.testing.assert_close(written.float(), want.flatten(0, 1)[slots].float(),
                                   **_tol(dtype))
        untouched = torch.ones(got.shape[0] * got.shape[1], dtype=torch.bool, device=DEV)
        untouched[slots] = False
        assert torch.equal(got.flatten(0, 1)[untouched].nan_to_num(0.0),
                           want.flatten(0, 1)[untouched]), "a write outside the rows' slots"


def _fused(K, x, splits=None, prefetch=None):
    return K.at.decode_attention_splits(x.q, x.kbad, x.vbad, x.tables, x.seq_lens, x.scale,
                                        splits, rope=(x.k, x.v, x.pos, x.cos, x.sin, x.slots),
                                        prefetch=prefetch)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,ctx,hq,hk,d,bs,splits", DECODE_CASES)
def test_rope_decode_attention(K, dtype, b, ctx, hq, hk, d, bs, splits):
    """Rope + KV write + attention in one kernel against the three references: the output,
    the new token's K and V in their slots (NaN there before), every other slot untouched."""
    x = _rope_decode_inputs(dtype, b, ctx, hq, hk, d, bs, 40 + b)
    _check(_fused(K, x, splits), x.ref, dtype, "attention")
    _check_cache_writes(x, dtype, x.slots)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("prefetch", [True, False])
def test_rope_decode_attention_new_token_anywhere(K, splits, prefetch):
    """The program whose split holds the new token's position writes it, wherever it is: the
    last position (a decode step), inside the context (read by an earlier split), or past it
    (written, read by nobody). With the first tile prefetched, a new token inside that tile
    comes from registers (its slot held NaN when the tile was read), one in a later tile from
    the cache."""
    dtype = torch.float16
    # lengths (_lengths): 1, 200, 16, 17, 31, 199
    x = _rope_decode_inputs(dtype, 6, 200, 8, 2, 64, 16, 80, offsets=[0, -150, -10, 1, -1, 0])
    assert x.pos.tolist() == [0, 49, 5, 17, 29, 198]
    _check(_fused(K, x, splits, prefetch), x.ref, dtype, "attention")
    _check_cache_writes(x, dtype, x.slots)


@kernel_test
@pytest.mark.gpu
def test_rope_decode_attention_negative_slot_writes_nothing(K):
    """A row whose slot is -1 (no write, as in write_kv) attends to the cache as it is; the
    guard block in front of the cache proves slot -1 was not written either."""
    dtype = torch.bfloat16
    x = _rope_decode_inputs(dtype, 4, 70, 8, 2, 64, 16, 50, no_write_row=2, guard=True)
    before_k, before_v = x.kbad.clone(), x.vbad.clone()
    _check(_fused(K, x, 3), x.ref, dtype, "attention")
    live = x.slots[[0, 1, 3]]
    for got, before in ((x.kbad, before_k), (x.vbad, before_v)):
        changed = ~((got == before) | (got.isnan() & before.isnan())).flatten(0, 1).all(-1).all(-1)
        expect = torch.zeros_like(changed)
        expect[live] = True
        assert torch.equal(changed, expect), "writes outside the rows' own slots"
        guard = got.as_strided((got.shape[1],) + tuple(got.shape[2:]),
                               got.stride()[1:], got.storage_offset() - got.stride(0))
        assert torch.equal(guard, torch.full_like(guard, 7.0)), "slot -1 was written"


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["head_dim_48", "fp32_k_into_bf16_cache"])
def test_rope_decode_attention_falls_back(K, case):
    """What the fused kernel does not take (a head dim that is not a power of two, K/V of
    another dtype than the cache) goes through the separate kernels, with the same result."""
    dtype = torch.bfloat16
    d = 48 if case == "head_dim_48" else 64
    x = _rope_decode_inputs(dtype, 3, 40, 4, 2, d, 16, 70)
    k, v = x.k, x.v
    if case == "fp32_k_into_bf16_cache":
        k, v = k.float(), v.float()
    out = K.ops.rope_decode_attention(x.q, k, v, x.pos, x.cos, x.sin, x.kbad, x.vbad,
                                      x.slots, x.tables, x.seq_lens, x.scale)
    _check(out, x.ref, dtype, "attention")
    _check_cache_writes(x, dtype, x.slots)


@kernel_test
@pytest.mark.gpu
def test_decode_attention_on_a_cache_of_uneven_block_strides_uses_the_reference(K):
    """A cache whose slots are not one flat run (blocks not evenly strided) cannot be addressed
    by flat slot; decode attention then returns the reference's result."""
    dtype = torch.bfloat16
    lens = [5, 40, 17]
    kc, vc, _, _, tables = _paged_cache(lens, 2, 64, 16, dtype, 90)
    q = _randn((3, 4, 64), dtype, 91)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ks, vs = (c.transpose(0, 1).contiguous().transpose(0, 1) for c in (kc, vc))
    assert not K.at._cache_ok(ks)
    _check(K.ops.decode_attention(q, ks, vs, tables, sl, 0.125),
           attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, 0.125), dtype, "attention")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_rope_decode_attention_writes_the_same_cache_bits_as_separate_kernels(K, dtype, d,
                                                                              splits):
    """The fused kernel writes bitwise the K and V that the separate Triton rope_write_kv
    writes (so prefill, which uses rope_write_kv, and decode agree on every cached key), and
    its output matches the separate rope + decode attention within the attention tolerance
    (on the H100 not bit for bit: q reaches the dot from registers instead of memory)."""
    b, ctx = big((33, 700), (3, 40))
    x = _rope_decode_inputs(dtype, b, ctx, 32, 8, d, 16, 60)
    k2, v2 = x.kbad.clone(), x.vbad.clone()
    fused = _fused(K, x, splits)
    q_rot = K.nr.rope_write_kv(x.q, x.k, x.v, x.pos, x.cos, x.sin, k2, v2, x.slots)
    separate = K.at.decode_attention_splits(q_rot, k2, v2, x.tables, x.seq_lens, x.scale,
                                            splits)
    assert torch.equal(x.kbad.nan_to_num(0.0), k2.nan_to_num(0.0))
    assert torch.equal(x.vbad.nan_to_num(0.0), v2.nan_to_num(0.0))
    _check(fused, separate, dtype, "attention")


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
    out = K.ap.prefill_attention_invariant(q, kbad, vbad, cu, sl, tables, scale)
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
    full = K.ap.prefill_attention_invariant(q, kc, vc, cu, sl, tables, 0.125)
    _check(full, attn_ref.paged_prefill_attention_ref(q, kc, vc, cu, sl, tables, 0.125), dtype,
           "attention")
    for i, n in enumerate(q_lens):
        rows = slice(cu_list[i], cu_list[i + 1])
        one = K.ap.prefill_attention_invariant(
            q[rows], kc, vc, torch.tensor([0, n], dtype=torch.int32, device=DEV), sl[i:i + 1],
            tables[i:i + 1], 0.125)
        assert torch.equal(one, full[rows]), i


@kernel_test
@pytest.mark.gpu
def test_split_counters_outgrown_buffer_stays_alive(K):
    """A launch needing more counters than the buffer holds gets a larger one; the old buffer,
    whose address earlier graphs captured, must stay allocated (and zero)."""
    first = ticket_counters(torch.device(DEV), 1)
    grown = ticket_counters(torch.device(DEV), first.numel() + 1)
    assert grown.numel() > first.numel() and grown.data_ptr() != first.data_ptr()
    from graphexec.kernels.tickets import _OUTGROWN
    assert any(t is first for t in _OUTGROWN)
    assert int(grown.abs().sum()) == 0 and int(first.abs().sum()) == 0
    assert ticket_counters(torch.device(DEV), 1) is grown


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["prefill_attention", "prefill_attention_invariant"])
@pytest.mark.parametrize("lead", [0, 5])
def test_prefill_attention_padded_as_a_captured_prefill_pads(K, variant, lead):
    """A captured prefill pads its batch (capture/prefill.py): tokens past cu_seqlens[-1] that
    belong to no sequence, and empty sequences after the real ones; a mixed step also puts its
    decode rows before cu_seqlens[0] (capture/mixed.py, `lead` of them). The real tokens'
    outputs are bitwise those of the unpadded call, and the padding reads nothing out of
    bounds."""
    dtype = torch.bfloat16
    seqs = big([(17, 0), (5, 30), (130, 7)], [(9, 0), (3, 5)])
    q_lens = [s[0] for s in seqs]
    lens = [s[0] + s[1] for s in seqs]
    kc, vc, _, _, tables = _paged_cache(lens, 2, 64, 16, dtype, 38)
    t, pad_t, pad_s = sum(q_lens), 23, 3
    q = _randn((lead + t + pad_t, 8, 64), dtype, 39)
    cu = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    fn = getattr(K.ap, variant)
    exact = fn(q[lead:lead + t], kc, vc, torch.tensor(cu, dtype=torch.int32, device=DEV),
               torch.tensor(lens, dtype=torch.int32, device=DEV), tables, 0.125)
    scratch = torch.zeros(pad_s, tables.shape[1], dtype=tables.dtype, device=DEV)
    padded = fn(q, kc, vc,
                torch.tensor([lead + c for c in cu] + [lead + t] * pad_s, dtype=torch.int32,
                             device=DEV),
                torch.tensor(lens + [0] * pad_s, dtype=torch.int32, device=DEV),
                torch.cat([tables, scratch]), 0.125)
    assert torch.equal(padded[lead:lead + t], exact)
