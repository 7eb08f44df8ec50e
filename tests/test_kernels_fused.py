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
    from graphexec.kernels.activation_triton import silu_mul

    _check(silu_mul(x), activation.silu_mul_ref(x), dtype)


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
def test_decode_metadata_past_the_table_maps_into_its_last_column(K):
    """A speculative step drafts up to K positions past a row's context limit: those land in
    the table's last column (the scratch block), never outside the table."""
    cols, bs = 3, 8
    tables = torch.tensor([[5, 6, 7], [9, 10, 11]], dtype=torch.int32).to(DEV)
    pos = torch.tensor([cols * bs + 2, cols * bs * 4 + 5], dtype=torch.int64).to(DEV)
    for slots, lens in (K.ops.decode_metadata(pos, tables, bs),
                        advance.decode_metadata_ref(pos, tables, bs)):
        assert slots.tolist() == [7 * bs + 2, 11 * bs + 5]
        assert lens.tolist() == [cols * bs + 3, cols * bs * 4 + 6]


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


def test_spec_advance_reference_by_hand():
    """Row 0 accepts one of two drafts (count 2), row 1 both (count 3, the bonus token), row 2
    is padding: the output holds every row, the state moves for live rows only."""
    tokens = torch.tensor([[5, 6, 7], [1, 2, 3], [4, 4, 4]])
    draft = torch.tensor([[5, 9], [1, 2], [4, 4]])
    ids, pos, steps = torch.zeros(3, dtype=torch.int64), torch.tensor([10, 20, 0]), \
        torch.tensor([1, 2, 0])
    out_tokens, out_count = torch.full((3, 3), -1), torch.full((3,), -1)
    advance.spec_advance_ref(tokens, None, draft, ids, pos, steps, torch.tensor([2]),
                             out_tokens, out_count)
    assert out_count.tolist() == [2, 3, 3] and torch.equal(out_tokens, tokens)
    assert ids.tolist() == [6, 3, 0]
    assert pos.tolist() == [12, 23, 0] and steps.tolist() == [3, 5, 0]


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("b,k,n", big([(1, 4, 1), (64, 4, 50), (16, 8, 16), (300, 1, 7)],
                                      [(1, 4, 1), (9, 3, 5), (4, 1, 0)]))
@pytest.mark.parametrize("greedy", [True, False])
def test_spec_advance(K, b, k, n, greedy):
    """The speculative advance against its reference: drafts that match the target's argmaxes
    for a random prefix (every count from 1 to K + 1 occurs), or given counts (sampled rows);
    the outputs are strided views of wider buffers, poisoned."""
    g = _gen(60)
    tokens = torch.randint(0, 50, (b, k + 1), generator=g)
    match = torch.randint(0, k + 1, (b,), generator=g)  # leading drafts that match
    draft = torch.where(torch.arange(k)[None, :] < match[:, None], tokens[:, :k],
                        tokens[:, :k] + 1)
    count = None if greedy else torch.randint(1, k + 2, (b,), generator=g).to(DEV)
    tokens, draft = tokens.to(DEV), draft.to(DEV)
    state = [torch.randint(0, 1000, (b,), generator=g).to(DEV) for _ in range(3)]
    ref_state = [t.clone() for t in state]
    num_rows = torch.tensor([n], device=DEV)
    out = torch.full((b, k + 3), -7, dtype=torch.int64, device=DEV)
    out_count = torch.full((b, 2), -7, dtype=torch.int64, device=DEV)
    ref_out, ref_count = out.clone(), out_count.clone()
    K.ops.spec_advance(tokens, count, draft, *state, num_rows, out[:, :k + 1], out_count[:, 0])
    advance.spec_advance_ref(tokens, count, draft, *ref_state, num_rows, ref_out[:, :k + 1],
                             ref_count[:, 0])
    for got, want in zip((*state, out, out_count), (*ref_state, ref_out, ref_count)):
        assert torch.equal(got, want)
    assert (out[:, k + 1:] == -7).all() and (out_count[:, 1] == -7).all()
    if greedy:
        assert torch.equal(out_count[:, 0].cpu(), match + 1)
