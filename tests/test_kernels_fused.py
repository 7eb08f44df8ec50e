"""The fused kernels of the decode iteration against their references: rotary embedding with the
KV-cache write, silu(gate) * up, the decode metadata (slot mapping, seq lens) and the advance."""
import pytest
import torch

from kernel_helpers import DEV, DTYPES, _check, _gen, _randn, big, kernel_test
from graphexec.kernels import activation, advance, rope as rope_ref


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hk,d,bs", big([(1, 32, 8, 128, 16), (64, 32, 8, 128, 16),
                                              (300, 14, 2, 64, 32), (5, 4, 4, 32, 16)],
                                             [(3, 4, 2, 32, 16), (5, 2, 1, 64, 8)]))
def test_rope_write_kv(K, dtype, t, hq, hk, d, bs):
    nb = t // bs + 4
    slots = torch.randperm(nb * bs, generator=_gen(20))[:t].to(DEV)
    slots[t // 2] = -1  # "no write"
    qkv = _randn((t, (hq + 2 * hk) * d), dtype, 21, 2.0)  # strided views of a fused projection
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)
    pos = torch.randint(0, 4000, (t,), generator=_gen(22)).to(DEV)
    cos, sin = rope_ref.rope_cos_sin(4096, d, 500000.0, device=DEV)
    kc = torch.full((nb, bs, hk, d), float("nan"), device=DEV, dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    kr, vr = kc.clone(), vc.clone()
    keep = slots >= 0  # the reference has no "no write": give it the written rows only
    q_out = K.ops.rope_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    q_ref, k_rot = rope_ref.apply_rope_ref(q, k, pos, cos, sin)
    flat = lambda c: c.view(nb * bs, hk, d)
    flat(kr).index_copy_(0, slots[keep], k_rot[keep])
    flat(vr).index_copy_(0, slots[keep], v[keep])
    _check(q_out, q_ref, dtype)
    assert torch.equal(torch.isnan(kc), torch.isnan(kr)), "a slot written that should not be"
    assert torch.equal(torch.isnan(vc), torch.isnan(vr))
    _check(kc.nan_to_num(0.0), kr.nan_to_num(0.0), dtype)
    assert torch.equal(vc.nan_to_num(0.0), vr.nan_to_num(0.0))


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", big([(1, 8192), (64, 14336), (7, 3000), (300, 256)],
                                    [(1, 64), (5, 300)]))
def test_silu_mul(K, dtype, t, i):
    x = _randn((t, 2 * i), dtype, 30, 3.0)
    _check(K.ops.silu_mul(x), activation.silu_mul_ref(x), dtype)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("b,bs", big([(1, 16), (64, 16), (257, 32), (1024, 16)],
                                     [(1, 16), (37, 8)]))
def test_decode_metadata(K, b, bs):
    cols = 9
    tables = torch.randint(0, 10**6, (b + 1, cols), generator=_gen(40), dtype=torch.int32)
    pos = torch.randint(0, cols * bs, (b + 1,), generator=_gen(41))
    pos[0], pos[-1] = 0, cols * bs - 1  # first and last slot of a table
    tables, pos = tables.to(DEV), pos.to(DEV)
    slots, lens = K.ops.decode_metadata(pos[:b], tables[:b], bs)
    ref_slots, ref_lens = advance.decode_metadata_ref(pos[:b], tables[:b], bs)
    assert slots.dtype == ref_slots.dtype and lens.dtype == ref_lens.dtype
    assert torch.equal(slots, ref_slots) and torch.equal(lens, ref_lens)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("b,n", big([(1, 1), (64, 40), (256, 256), (1100, 3)],
                                    [(1, 1), (9, 4), (9, 0)]))
@pytest.mark.parametrize("with_out", [False, True])
def test_advance(K, b, n, with_out):
    """The advance against its reference; with sampled_out, every row's token (padding rows
    too) lands in column 0 of a strided output and nothing else of it is touched."""
    g = _gen(50)
    state = [torch.randint(0, 1000, (b,), generator=g).to(DEV) for _ in range(4)]
    tokens, ids, pos, steps = state
    ref = [t.clone() for t in (ids, pos, steps)]
    num_rows = torch.tensor([n], device=DEV)
    out = torch.full((b, 3), -7, dtype=torch.int64, device=DEV)
    ref_out = out.clone()
    K.ops.advance(tokens, ids, pos, steps, num_rows, out[:, 0] if with_out else None)
    advance.advance_ref(tokens, *ref, num_rows, ref_out[:, 0] if with_out else None)
    for got, want in zip((ids, pos, steps, out), (*ref, ref_out)):
        assert torch.equal(got, want)
    assert torch.equal(ids[:n], tokens[:n]) and (ids[n:] == 0).all()
    if with_out:
        assert torch.equal(out[:, 0], tokens) and (out[:, 1:] == -7).all()
    else:
        assert (out == -7).all()
