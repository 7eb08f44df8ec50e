"""The fused tensor-core projections of kernels/linear_triton.py (what `op_sets.FusedOps`
runs for multi-row decode batches) against PyTorch: gate_up with the silu * mul epilogue against
F.linear in fp32 and kernels/activation.py; the residual epilogue (and the
split-K sum that carries it) against F.linear in fp32 plus the add; and a whole model on the
fused op set against the fp32 reference model."""
import pytest
import torch

from graphexec.kernels import activation as act_ref
from kernel_helpers import DEV, INTERPRET, _check, _randn, big, kernel_test

# (m, intermediate, hidden): ragged row and column counts hit the masks
SILU_SHAPES = big([(64, 8192, 2048), (33, 1000, 896), (5, 2048, 1024), (2, 64, 256)],
                  [(3, 40, 96), (17, 24, 64)])
SILU_CONFIGS = big([None, (64, 32, 64, 1), (16, 16, 128, 1), (64, 64, 128, 1)],
                   [None, (16, 16, 32, 1)])


def _fused_ops(base, min_rows: int = 2, max_rows: int = 64, **tuning):
    """kernels/op_sets.FusedOps over base for min_rows..max_rows rows, as the Ops it gives."""
    from dataclasses import replace

    from graphexec.kernels.op_sets import FusedOps
    from graphexec.kernels.tuning import DEFAULT
    from graphexec.kernels.weight_order import WeightOrder

    t = replace(DEFAULT.linear, fused_min_rows=min_rows, fused_max_rows=max_rows, **tuning)
    return FusedOps(base, t, WeightOrder()).ops()


def _auto_ops():
    """projections="auto" with the shipped table."""
    from graphexec.kernels.triton_ops import op_set
    from graphexec.kernels.tuning import DEFAULT

    return op_set("auto", False, DEFAULT)


def _ref_linear(x, w):
    return (x.float() @ w.float().t()).to(x.dtype)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,inter,hidden", SILU_SHAPES)
@pytest.mark.parametrize("config", SILU_CONFIGS)
def test_linear_silu(K, m, inter, hidden, config):
    dtype = torch.bfloat16
    x = _randn((m, hidden), dtype, 40)
    w = _randn((2 * inter, hidden), dtype, 43, hidden ** -0.5)
    cfg = K.lt.LinearConfig(*config) if config else None
    act = K.lf.linear_silu(x, w, config=cfg)
    assert act.shape == (m, inter)
    assert not torch.isnan(act).any()
    # Against fp32. The kernel rounds both projections, silu and the product to bf16, as the
    # separate kernels do, and a product of two rounded values carries each one's error scaled
    # by the other: an element near zero has the absolute error of the row's scale, not its
    # own. So: no element off by more than 2% of the output's scale, and no larger error
    # overall than the separate kernels' (projection, then silu * mul) against the same truth.
    gate, up = (x.float() @ w.float().t()).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    if INTERPRET:  # it truncates at each of those roundings where the GPU rounds to nearest
        torch.testing.assert_close(act.float(), want, rtol=0.05, atol=0.05)
        return
    torch.testing.assert_close(act.float(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
    separate = act_ref.silu_mul_ref(torch.nn.functional.linear(x, w)).float()
    err = (act.float() - want).norm() / want.norm()
    assert err <= 1.25 * (separate - want).norm() / want.norm() + 1e-3


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", big([(64, 2048, 8192), (64, 2048, 2048), (33, 1000, 896),
                                       (2, 3072, 2048)], [(3, 40, 96), (17, 24, 160)]))
@pytest.mark.parametrize("config", big([None, (64, 16, 128, 1), (64, 32, 128, 4),
                                        (16, 16, 256, 2)], [None, (16, 16, 32, 3)]))
def test_linear_add(K, m, n, k, config):
    """Split K (config split > 1) takes the residual in the partial-sum kernel."""
    dtype = torch.bfloat16
    x = _randn((m, k), dtype, 44)
    w = _randn((n, k), dtype, 45, k ** -0.5)
    res = _randn((m, n), dtype, 46, 3.0)
    cfg = K.lt.LinearConfig(*config) if config else None
    out = K.lf.linear_add(x, w, res, config=cfg)
    # the projection rounded to the dtype, then the fp32 add, as the reference add_rms_norm
    want = (_ref_linear(x, w).float() + res.float()).to(dtype)
    _check(out, want, dtype, "reduction")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", big([(64, 2048, 8192), (64, 2048, 2048), (33, 1000, 896)],
                                      [(17, 24, 160), (3, 40, 96)]))
@pytest.mark.parametrize("config", big([None, (64, 16, 128, 1), (64, 64, 128, 4)],
                                       [None, (16, 16, 32, 3)]))
def test_residual_epilogue_begins_the_next_norm(K, m, n, k, config):
    """linear_add with next_norm (Prenormed): the same stream h as without, g = h * norm weight
    rounded once, and per-tile sums of squares that add up to each row's (the split-K sum
    kernel's share included)."""
    dtype = torch.bfloat16
    x = _randn((m, k), dtype, 60)
    w = _randn((n, k), dtype, 61, k ** -0.5)
    res = _randn((m, n), dtype, 62, 3.0)
    nw = (1.0 + 0.2 * _randn((n,), torch.float32, 63)).to(dtype)
    cfg = K.lt.LinearConfig(*config) if config else None
    p = K.lf.linear_add(x, w, res, config=cfg, next_norm=nw)
    assert isinstance(p, K.lf.Prenormed) and p.norm_weight is nw
    assert torch.equal(p.h, K.lf.linear_add(x, w, res, config=cfg))
    g = (p.h.float() * nw.float()).to(dtype)
    if INTERPRET:  # it truncates to bf16 where the GPU rounds to nearest: one ulp
        torch.testing.assert_close(p.g, g, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(p.g, g)
    torch.testing.assert_close(p.ss.sum(0), p.h.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,hidden,n", big([(64, 2048, 3072), (48, 2048, 8192), (33, 896, 1000)],
                                           [(17, 64, 48), (3, 96, 40)]))
@pytest.mark.parametrize("silu_out,split", [(False, 1), (True, 1), (False, 2)])
def test_prenormed_projection_equals_norm_then_projection(K, m, hidden, n, silu_out, split):
    """A projection of a Prenormed (g in, 1 / rms(h) in the epilogue) against the RMSNorm
    reference and an fp32 projection: no less accurate than the norm kernel and the projection
    in two launches, the path it replaces. split 2: each K split streams the per-tile sums over
    its own (fewer) K blocks."""
    from graphexec.kernels import rmsnorm
    config = None
    if split > 1:
        big_k = hidden >= 512
        config = K.lt.LinearConfig(64 if big_k else 16, 64 if big_k else 16,
                                   128 if big_k else 16, split)
    dtype, eps = torch.bfloat16, 1e-5
    h = _randn((m, hidden), dtype, 64, 3.0)
    nw = (1.0 + 0.2 * _randn((hidden,), torch.float32, 65)).to(dtype)
    w = _randn(((2 if silu_out else 1) * n, hidden), dtype, 66, hidden ** -0.5)
    # the Prenormed of h itself: h = 0 @ W + h through the residual epilogue
    zero = torch.zeros((m, 16), dtype=dtype, device=DEV)
    p = K.lf.linear_add(zero, torch.zeros((hidden, 16), dtype=dtype, device=DEV), h,
                        next_norm=nw)
    assert torch.equal(p.h, h)
    assert p.ss.shape[0] > 1  # several tiles' sums to stream
    out = K.lf.prenormed_linear(p, eps, w, config=config, silu_out=silu_out)
    normed = rmsnorm.rms_norm_ref(h.float(), nw.float(), eps)
    truth = normed @ w.float().t()
    two = K.lt.linear(rmsnorm.rms_norm_ref(h, nw, eps), w)  # the norm kernel's rounding
    if silu_out:
        truth = act_ref.silu_mul_ref(truth)
        two = act_ref.silu_mul_ref(two)
    assert out.shape == (m, n) and not torch.isnan(out).any()
    err = (out.float() - truth).norm() / truth.norm()
    if INTERPRET:  # it truncates at every bf16 rounding where the GPU rounds to nearest
        assert err <= 0.03
        return
    assert err <= 1.25 * (two.float() - truth).norm() / truth.norm() + 1e-3


@kernel_test
@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="the interpreter runs no inline PTX: no hint is issued")
@pytest.mark.parametrize("m", [1, 64])
def test_l2_prefetch_changes_no_result(K, m):
    """Warming L2 with the next weight (kernels/l2_prefetch.py) only moves where later loads
    are served from: every fused projection gives the same bits with the hint as without."""
    from graphexec.kernels.l2_prefetch import lines_per_program
    h, inter = 2048, 4096
    x, res = _randn((m, h), torch.bfloat16, 71), _randn((m, h), torch.bfloat16, 72)
    act = _randn((m, inter), torch.bfloat16, 73)
    gate_up = _randn((2 * inter, h), torch.bfloat16, 74, h ** -0.5)
    down = _randn((h, inter), torch.bfloat16, 75, inter ** -0.5)
    nxt = _randn((3 * h, h), torch.bfloat16, 76)
    assert lines_per_program(nxt, 4 << 20, 128) > 0
    runs = []
    for hint in (dict(), dict(prefetch=nxt, prefetch_bytes=4 << 20)):
        runs.append((K.lt.linear(x, down.t().contiguous(), **hint),
                     K.lf.linear_silu(x, gate_up, **hint),
                     K.lf.linear_add(act, down, res, **hint),
                     K.lf.linear_add(act, down, res, config=K.lt.LinearConfig(64, 64, 128, 4),
                                     **hint)))
    for plain, hinted in zip(*runs):
        assert torch.equal(plain, hinted)


def test_weights_link_in_launch_order_and_hint_sizes():
    from graphexec.kernels.l2_prefetch import lines_per_program
    from graphexec.kernels.weight_order import WeightOrder
    ws = [torch.zeros(64, 32, dtype=torch.bfloat16) for _ in range(3)]
    order = WeightOrder()
    order.link(ws)
    assert order.next(ws[0]) is ws[1] and order.next(ws[1]) is ws[2]
    assert order.next(ws[2]) is None and order.next(torch.zeros(2)) is None
    order.link([ws[0], ws[2]])  # a later model over the same weights: first link stays
    assert order.next(ws[0]) is ws[1]
    assert WeightOrder().next(ws[0]) is None  # another op set's order knows none of them
    # 4 KiB = 32 lines of 128 bytes over 8 programs: 4 each; capped by max_bytes; none asked
    assert lines_per_program(ws[0], 1 << 20, 8) == 4
    assert lines_per_program(ws[0], 1024, 8) == 1
    assert lines_per_program(ws[0], 0, 8) == 0 and lines_per_program(None, 1 << 20, 8) == 0


@kernel_test
@pytest.mark.gpu
def test_silu_epilogue_refuses_split_k(K):
    x = _randn((4, 256), torch.bfloat16, 47)
    w = _randn((64, 256), torch.bfloat16, 49)
    with pytest.raises(ValueError, match="split_k=2"):
        K.lf.linear_silu(x, w, config=K.lt.LinearConfig(16, 16, 32, 2))


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("qkv_triton", [False, True])
def test_model_forward_on_fused_ops(K, hf_dirs_moderate, packed, qkv_triton):
    """The whole bf16 model on the fused op set is as accurate, against the fp32 reference
    model, as on the unfused Triton set: the three prompts packed into one forward (22 rows,
    inside the fused range), or one token alone (outside it: there the two op sets must agree
    bitwise)."""
    from graphexec.kernels import REFERENCE_OPS
    from graphexec.kernels.triton_ops import TRITON_OPS
    from test_hf_parity import PROMPTS, _graphexec_prefill_logits

    path, _ = hf_dirs_moderate["llama"]
    dev = str(DEV)
    fused = _fused_ops(TRITON_OPS, fused_qkv_max_elements=1 << 62 if qkv_triton else 0)
    prompts = PROMPTS if packed else [PROMPTS[0][:1]]
    truth = _graphexec_prefill_logits(path, dev, torch.float32, prompts, ops=REFERENCE_OPS)
    base = _graphexec_prefill_logits(path, dev, torch.bfloat16, prompts, ops=TRITON_OPS)
    ours = _graphexec_prefill_logits(path, dev, torch.bfloat16, prompts, ops=fused)
    for mine, plain, exact in zip(ours, base, truth):
        if not packed:
            assert torch.equal(mine, plain)
        err = ((mine - exact).norm() / exact.norm()).item()
        base_err = ((plain - exact).norm() / exact.norm()).item()
        assert err <= 1.25 * base_err + 1e-3, (err, base_err)


@kernel_test
@pytest.mark.gpu
def test_auto_ops_fuse_the_epilogues_from_33_to_64_rows(K):
    """projections="auto": from fused_min_rows to fused_max_rows rows o and down add the
    residual in their epilogue and gate_up applies silu * mul in its (residual None comes
    back: already added), and a small qkv weight runs on Triton; other row counts leave the
    add to the next norm and run cuBLAS."""
    from graphexec.kernels.tuning import DEFAULT

    ops, lt, lf, t = _auto_ops(), K.lt, K.lf, DEFAULT.linear
    h, inter = big((2048, 4096), (64, 96))
    w_o = _randn((h, h), torch.bfloat16, 50, h ** -0.5)
    w_gu = _randn((2 * inter, h), torch.bfloat16, 51, h ** -0.5)
    w_down = _randn((h, inter), torch.bfloat16, 52, inter ** -0.5)
    nw = (1.0 + 0.2 * _randn((h,), torch.float32, 53)).to(torch.bfloat16)
    for m in (32, 33, 64):
        x, res = _randn((m, h), torch.bfloat16, 54), _randn((m, h), torch.bfloat16, 55)
        out, r = ops.out_linear(x, w_o, res)
        y, r2 = ops.mlp(x, res, nw, 1e-6, w_gu, w_down)
        qkv, summed = ops.norm_linear(x, None, nw, 1e-6, w_o)  # a small weight, as qkv
        if t.fused_min_rows <= m <= t.fused_max_rows:
            cfg = lf.pick_fused_config(m, h, h, "qkv")
            assert torch.equal(qkv, lt.linear(lt._norm(x, None, nw, 1e-6)[0], w_o, config=cfg))
            assert r is None and torch.equal(out, lf.linear_add(x, w_o, res))
            normed, summed = lt._norm(x, res, nw, 1e-6)
            want = lf.linear_add(lf.linear_silu(normed, w_gu), w_down, summed)
            assert r2 is None and torch.equal(y, want)
        else:
            assert torch.equal(qkv, ops.linear(lt._norm(x, None, nw, 1e-6)[0], w_o))
            assert r is res and torch.equal(out, ops.linear(x, w_o))
            gate_up, summed = ops.norm_linear(x, res, nw, 1e-6, w_gu)
            assert torch.equal(r2, summed)
            assert torch.equal(y, ops.silu_mul_linear(gate_up, w_down))


@kernel_test
@pytest.mark.gpu
def test_rank_sets_return_partial_sums_and_pass_the_residual_on(K):
    """Under tensor parallelism (FusedOps(rank=r), through Ops.for_rank): o and down of every
    rank return its partial sum alone, at 33-64 rows on linear_add's kernel without the add,
    and hand the residual stream on for the all-reduce to add once; no norm is begun (a
    Prenormed of a partial sum would be wrong). mlp of a Normed (its add and norm done by the
    all-reduce before it) gives what mlp of the stream gives; norm_linear of one is the
    projection alone, on the fused qkv config at 33-64 rows. Summed over two ranks, plus the
    residual, they give the whole projections."""
    from graphexec.kernels import Normed
    from graphexec.kernels.tuning import DEFAULT

    lf, fused_min_rows = K.lf, DEFAULT.linear.fused_min_rows
    h, inter = big((2048, 4096), (64, 96))
    bf = torch.bfloat16
    w_o = _randn((h, h), bf, 60, h ** -0.5)
    w_gu = _randn((2 * inter, h), bf, 61, h ** -0.5)
    w_down = _randn((h, inter), bf, 62, inter ** -0.5)
    nw = (1.0 + 0.2 * _randn((h,), torch.float32, 63)).to(bf)
    half, ih = h // 2, inter // 2
    # rank r: o's input columns, gate's and up's output rows, down's input columns of its half
    gu = [torch.cat([w_gu[r * ih:(r + 1) * ih], w_gu[inter + r * ih:inter + (r + 1) * ih]])
          for r in (0, 1)]
    ranks = [_auto_ops().for_rank(r) for r in (0, 1)]
    for m in (1, 32, 64):
        x, res = _randn((m, h), bf, 64), _randn((m, h), bf, 65)
        normed, summed = K.lt._norm(x, res, nw, 1e-6)
        outs = [ops.out_linear(x[:, r * half:(r + 1) * half], w_o[:, r * half:(r + 1) * half],
                               res, nw) for r, ops in enumerate(ranks)]
        mlps = [ops.mlp(x, res, nw, 1e-6, gu[r], w_down[:, r * ih:(r + 1) * ih], nw)
                for r, ops in enumerate(ranks)]
        given_normed = [ops.mlp(Normed(normed, summed, nw), None, nw, 1e-6, gu[r],
                                w_down[:, r * ih:(r + 1) * ih], nw)
                        for r, ops in enumerate(ranks)]
        assert all(r is res and isinstance(o, torch.Tensor) for o, r in outs)
        assert all(torch.equal(r, summed) for _, r in mlps)
        assert all(r is summed for _, r in given_normed)
        if m >= fused_min_rows:
            for r in (0, 1):
                cols = slice(r * half, (r + 1) * half)
                assert torch.equal(outs[r][0], lf.linear_partial(x[:, cols], w_o[:, cols]))
        qkv, r = ranks[1].norm_linear(Normed(normed, summed, nw), None, nw, 1e-6, w_o)
        assert r is summed  # w_o stands for a small qkv weight
        if m >= fused_min_rows:
            cfg = lf.pick_fused_config(m, h, h, "qkv")
            assert torch.equal(qkv, K.lt.linear(normed, w_o, config=cfg))
        else:
            assert torch.equal(qkv, ranks[1].linear(normed, w_o))
        if m > 1:  # the same norm kernel either way (one row: the norm in gate_up's prologue)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(mlps, given_normed))
        whole = (_ref_linear(x, w_o).float() + res.float()).to(bf)
        _check((outs[0][0].float() + outs[1][0].float() + res.float()).to(bf), whole, bf,
               "reduction")
        act = torch.nn.functional.silu((normed.float() @ w_gu.float().t())[:, :inter]) * (
            normed.float() @ w_gu.float().t())[:, inter:]
        want = (act @ w_down.float().t() + summed.float()).to(bf)
        for outputs in (mlps, given_normed):
            got = (outputs[0][0].float() + outputs[1][0].float() + summed.float()).to(bf)
            assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2


@kernel_test
@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="an LM head has >= 65536 rows: too slow interpreted")
@pytest.mark.parametrize("m", [16, 33, 64])
def test_lm_head_of_fused_rows_on_triton(K, m):
    """The LM head (a weight of wide_weight_rows+ rows) of a 33-64-row batch: the norm, then
    the tensor-core Triton kernel with its lm_head tile; other row counts as the base op set.
    Both against PyTorch's norm and projection."""
    from graphexec.kernels.linear import norm_linear_ref
    from graphexec.kernels.tuning import DEFAULT

    ops, lt, lf, t = _auto_ops(), K.lt, K.lf, DEFAULT.linear
    h, vocab = 256, t.wide_weight_rows + 1000  # ragged: the last tile is masked
    w = _randn((vocab, h), torch.bfloat16, 60, h ** -0.5)
    nw = (1.0 + 0.2 * _randn((h,), torch.float32, 61)).to(torch.bfloat16)
    x, res = _randn((m, h), torch.bfloat16, 62), _randn((m, h), torch.bfloat16, 63)
    logits, summed = ops.norm_linear(x, res, nw, 1e-6, w)
    want, want_sum = norm_linear_ref(x, res, nw, 1e-6, w)  # torch on the same bf16 operands
    _check(summed, want_sum, torch.bfloat16)
    # Against the fp32 norm and projection of the (bf16-rounded) sum: at most as far off as
    # torch's own bf16 computation, give or take (logits reach several units: 1 ulp is 0.03).
    exact = norm_linear_ref(want_sum.float(), None, nw.float(), 1e-6, w.float())[0]
    ours_err = (logits.float() - exact).abs().max().item()
    torch_err = (want.float() - exact).abs().max().item()
    assert logits.shape == want.shape and logits.dtype == want.dtype
    assert ours_err <= 2 * torch_err + 1e-3, (ours_err, torch_err)
    normed = lt._norm(x, res, nw, 1e-6)[0]
    if t.fused_min_rows <= m <= t.fused_max_rows:
        cfg = lf.pick_fused_config(m, vocab, h, "lm_head")
        assert torch.equal(logits, lt.linear(normed, w, config=cfg))


@kernel_test
@pytest.mark.gpu
def test_decode_step_on_fused_ops(K, hf_dirs_moderate):
    """A decode step of 33 rows (inside the fused range: the fused rope + attention prefetching
    behind the Triton qkv, with four warps; o, gate_up and down with their epilogues) after
    each row's prompt was prefilled: as accurate against the fp32 reference model as the
    unfused Triton set."""
    from graphexec.kernels import REFERENCE_OPS
    from graphexec.kernels.triton_ops import TRITON_OPS
    from graphexec.model import LlamaModel, ModelConfig, load_weights
    from graphexec.model.llama import AttentionInputs, KVCache

    path, _ = hf_dirs_moderate["llama"]
    mc = ModelConfig.from_dir(path)
    rows, bs, per_row = 33, 4, 3  # prompts of 1-7 tokens, then one decoded token
    lens = [1 + i % 7 for i in range(rows)]
    prompts = [[(17 * i + 5 * j) % 250 + 2 for j in range(n)] for i, n in enumerate(lens)]
    tables = torch.arange(rows * per_row).view(rows, per_row).flip(0).int().to(DEV)
    t = lambda x: torch.tensor(x, device=DEV)

    def logits(ops, dtype):
        model = LlamaModel(mc, load_weights(path, mc, DEV, dtype), ops, max_positions=64)
        shape = (rows * per_row, bs, mc.num_kv_heads, mc.head_dim)
        kv = KVCache([torch.zeros(shape, dtype=dtype, device=DEV) for _ in range(mc.num_layers)],
                     [torch.zeros(shape, dtype=dtype, device=DEV) for _ in range(mc.num_layers)])
        # the prompts but their last token, one prefill for all rows; then that token decoded
        ids, pos, slots, cu = [], [], [], [0]
        for r, p in enumerate(prompts):
            for i, tok in enumerate(p[:-1]):
                ids.append(tok), pos.append(i)
                slots.append(int(tables[r, i // bs]) * bs + i % bs)
            cu.append(len(ids))
        if ids:
            has = [r for r in range(rows) if lens[r] > 1]
            pre = AttentionInputs(slot_mapping=t(slots), block_tables=tables[has],
                                  seq_lens=t([lens[r] - 1 for r in has]).int(),
                                  cu_seqlens_q=t([0] + [cu[r + 1] for r in has]).int())
            model.forward(t(ids), t(pos), pre, kv)
        last = [n - 1 for n in lens]
        dec = AttentionInputs(
            slot_mapping=t([int(tables[r, p // bs]) * bs + p % bs for r, p in enumerate(last)]),
            block_tables=tables, seq_lens=t(lens).int(), rows_are_sequences=True)
        return model.compute_logits(model.forward(t([p[-1] for p in prompts]), t(last), dec,
                                                  kv)).float()

    truth = logits(REFERENCE_OPS, torch.float32)
    base = logits(TRITON_OPS, torch.bfloat16)
    ours = logits(_fused_ops(TRITON_OPS), torch.bfloat16)
    err = ((ours - truth).norm() / truth.norm()).item()
    base_err = ((base - truth).norm() / truth.norm()).item()
    assert err <= 1.25 * base_err + 1e-3, (err, base_err)
