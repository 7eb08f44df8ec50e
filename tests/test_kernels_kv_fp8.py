"""An fp8 (e4m3) KV cache (kv_cache_dtype="fp8") through the Triton KV writes and attention,
against the references on the same cache: writes saturate at 448 like the reference's cast,
and decode, fused rope + decode, and prefill attention read fp8 keys and values as the
references read them."""
import pytest
import torch

from kernel_helpers import DEV, _check, _gen, _lengths, _paged_cache, _randn, attn_ref, \
    kernel_test, rope_ref

FP8 = torch.float8_e4m3fn
# one e4m3 step is 1/8 of the value at most: a write rounded once (fp32 -> fp8, the kernels)
# or twice (fp32 -> bf16 -> fp8, the reference) may land one step apart
FP8_STEP = dict(rtol=0.13, atol=2e-3)


def _fp8_cache(lens, hk, d, bs, seed, scale=1.0):
    kc, vc, _, _, tables = _paged_cache(lens, hk, d, bs, torch.float32, seed)
    return (kc * scale).to(FP8), (vc * scale).to(FP8), tables


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
def test_write_kv_saturates_like_the_reference(K, src):
    from graphexec.kernels.write_kv_triton import write_kv

    t, hk, d, bs, nb = 9, 2, 32, 8, 4
    slots = torch.randperm(nb * bs, generator=_gen(1))[:t].to(DEV)
    k = _randn((t, hk, d), src, 2, 300.0)  # a few past 448
    v = _randn((t, hk, d), src, 3)
    assert k.float().abs().max() > 448
    kc, vc = (torch.zeros(nb, bs, hk, d, device=DEV, dtype=FP8) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    write_kv(kc, vc, k, v, slots)
    attn_ref.write_kv_ref(kr, vr, k, v, slots)
    assert not kc.float().isnan().any() and kc.float().abs().max() == 448
    torch.testing.assert_close(kc.float(), kr.float(), **FP8_STEP)
    torch.testing.assert_close(vc.float(), vr.float(), **FP8_STEP)


@kernel_test
@pytest.mark.gpu
def test_rope_write_kv_into_fp8(K):
    from graphexec.kernels.rope import rope_cos_sin

    t, hq, hk, d, bs, nb = 5, 4, 2, 32, 8, 4
    dtype = torch.bfloat16
    q, k, v = (_randn((t, h, d), dtype, 10 + i) for i, h in enumerate((hq, hk, hk)))
    pos = torch.tensor([0, 3, 7, 8, 20], device=DEV)
    slots = torch.randperm(nb * bs, generator=_gen(4))[:t].to(DEV)
    cos, sin = rope_cos_sin(32, d, 10000.0, device=DEV)
    kc, vc = (torch.zeros(nb, bs, hk, d, device=DEV, dtype=FP8) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    q_out = K.ops.rope_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    q_ref = rope_ref.rope_write_kv_ref(q, k, v, pos, cos, sin, kr, vr, slots)
    _check(q_out, q_ref, dtype)
    torch.testing.assert_close(kc.float(), kr.float(), **FP8_STEP)
    assert torch.equal(vc.float(), vr.float())  # v is not rotated: one rounding either way


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 3])
# 4 rows take the narrow tiles of short batches; 6 rows over longer contexts the fp8 cache's
# own (AttentionTuning.decode_fp8_block_n), bf16 q then dotting in fp16
@pytest.mark.parametrize("b,ctx", [(4, 70), (6, 300)])
def test_decode_attention_reads_fp8(K, dtype, splits, b, ctx):
    hq, hk, d, bs = 8, 2, 64, 16
    lens = _lengths(b, ctx, bs, 20)
    kc, vc, tables = _fp8_cache(lens, hk, d, bs, 21)
    q = _randn((b, hq, d), dtype, 22)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, d ** -0.5)
    out = K.at.decode_attention_splits(q, kc, vc, tables, seq_lens, d ** -0.5, splits)
    _check(out, ref, dtype, "attention")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_fused_rope_decode_attention_writes_and_reads_fp8(K, splits):
    from graphexec.kernels.rope import rope_cos_sin

    b, ctx, hq, hk, d, bs = 3, 40, 4, 2, 64, 16
    dtype = torch.bfloat16
    lens = _lengths(b, ctx, bs, 30)
    kc, vc, tables = _fp8_cache(lens, hk, d, bs, 31)
    q, k, v = (_randn((b, h, d), dtype, 32 + i) for i, h in enumerate((hq, hk, hk)))
    pos = torch.tensor([n - 1 for n in lens], device=DEV)
    slots = torch.stack([tables[i, p // bs].long() * bs + p % bs
                         for i, p in enumerate(pos.tolist())])
    cos, sin = rope_cos_sin(ctx + 8, d, 10000.0, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kr, vr = kc.clone(), vc.clone()
    ref = attn_ref.rope_decode_attention_ref(q, k, v, pos, cos, sin, kr, vr, slots, tables,
                                             seq_lens, d ** -0.5)
    out = K.at.decode_attention_splits(q, kc, vc, tables, seq_lens, d ** -0.5, splits,
                                       rope=(k, v, pos, cos, sin, slots))
    _check(out, ref, dtype, "attention")
    torch.testing.assert_close(kc.float(), kr.float(), **FP8_STEP)
    assert torch.equal(vc.float(), vr.float())


@kernel_test
@pytest.mark.gpu
def test_prefill_attention_reads_fp8(K):
    dtype = torch.bfloat16
    seqs, hq, hk, d, bs = [(17, 0), (5, 30), (20, 16)], 8, 2, 64, 16
    q_lens = [s[0] for s in seqs]
    lens = [s[0] + s[1] for s in seqs]
    kc, vc, tables = _fp8_cache(lens, hk, d, bs, 40)
    q = _randn((sum(q_lens), hq, d), dtype, 41)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = attn_ref.paged_prefill_attention_ref(q, kc, vc, cu, sl, tables, d ** -0.5)
    out = K.ops.prefill_attention(q, kc, vc, cu, sl, tables, d ** -0.5)
    _check(out, ref, dtype, "attention")
