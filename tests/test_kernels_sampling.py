"""The threshold-search sampler against the reference: same tokens, every path, batch
invariance, and the sampled distribution (chi-square)."""
import math
from dataclasses import replace

import pytest
import torch

from graphexec.kernels.tuning import DEFAULT
from kernel_helpers import (
    CPU_MODE, DEV, SAMPLE_MODES, _chi2_critical, _gen, _sample_inputs, big,
    kernel_test, samp_ref)


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
    [(1200, dict(chunk=128, sub=32, top_r=1, cap=128, small_cap=32, scan_block=16,
                 fb_block=128))]))
@pytest.mark.parametrize("dtype", big([torch.bfloat16, torch.float32, torch.float16],
                                      [torch.float32, torch.bfloat16, torch.float16]))
def test_sample_every_path(K, v, knobs, dtype):
    """Shrunk knobs send rows down every path: greedy, unfiltered, the two candidate sorts and
    the exact fallback; all must give the reference's token. bf16 / fp16: the logits the model
    hands over, read by every path of the kernel and upcast exactly."""
    tuning = replace(DEFAULT.sampling, **knobs)
    chunk, sub, top_r = tuning.chunk, tuning.sub, tuning.top_r
    small, cap = tuning.small_cap, tuning.cap
    table = math.ceil(v / chunk) * (chunk // sub) * top_r
    k_full = (small + min(table, cap)) // 2  # candidates between the two sort sizes
    modes = SAMPLE_MODES + [(1.0, k_full, 1.0, 3.0), (1.0, k_full, 0.99, 3.0),
                            (1.0, 100, 0.99, 3.0)]
    b = len(modes) + big(len(modes), 0)
    args = _sample_inputs(b, v, 50, modes=modes)
    args = (args[0].to(dtype),) + args[1:]
    path = torch.full((b,), -1, dtype=torch.int32, device=DEV)
    out = K.st.sample_impl(*args, path=path, tuning=tuning)
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
        small = replace(DEFAULT.sampling, chunk=16, sub=16, cap=16, small_cap=16, scan_block=16)
        toks = K.st.sample_impl(logits, temps, ks, ps, seeds, steps, tuning=small)
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
def test_mask_stop_tokens_reads_broadcast_rows(K):
    """A speculative verify passes one request's steps / min_tokens for its K + 1 rows: views
    with stride 0 (and a step vector with stride 2) must be read as such, not as dense
    vectors. Rows 0-3 repeat one request below its floor: every row masks its stop id."""
    from graphexec.kernels.stop_tokens_triton import mask_stop_tokens

    v = 64
    logits = torch.zeros(4, v, device=DEV)
    stop_ids = torch.tensor([[5, -1]], device=DEV).expand(4, 2)
    min_tokens = torch.tensor([10, 0, 0, 0], device=DEV)[:1].expand(4)  # stride 0
    steps = torch.tensor([1, 99, 2, 99, 3, 99, 4, 99], device=DEV)[::2]  # stride 2
    for fn in (mask_stop_tokens, samp_ref.mask_stop_tokens_ref):
        out = fn(logits.clone(), stop_ids.contiguous(), steps, min_tokens)
        assert torch.isinf(out[:, 5]).all(), fn.__name__
        assert (out[:, :5] == 0).all() and (out[:, 6:] == 0).all()


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [True, False])
def test_mask_stop_tokens_matches_a_loop(K, dtype, inplace):
    """min_tokens: a row below its floor gets -inf at each of its stop ids (-1 pads the list,
    duplicates allowed); every other entry and every row at or past its floor are untouched.
    The Triton kernel and the reference against a plain loop over the rows."""
    from graphexec.kernels.stop_tokens_triton import mask_stop_tokens

    b, v, s = 9, 1000, 16
    g = _gen(70)
    logits = torch.randn(b, v, generator=g).to(DEV, dtype)
    stop_ids = torch.full((b, s), -1, dtype=torch.int64)
    for i in range(b):
        n = i % 5
        stop_ids[i, :n] = torch.randint(0, v, (n,), generator=g)
    stop_ids[3, 1] = stop_ids[3, 0]  # a duplicate id
    stop_ids[4, 0] = 0  # id 0 next to -1 padding (the reference clamps padding onto 0)
    steps = torch.randint(0, 6, (b,), generator=g)
    min_tokens = torch.randint(0, 6, (b,), generator=g)
    expected = logits.clone()
    for i in range(b):
        if steps[i] < min_tokens[i]:
            for t in stop_ids[i].tolist():
                if t >= 0:
                    expected[i, t] = float("-inf")
    assert not torch.equal(expected, logits)  # the case masks something
    dev = dict(device=DEV)
    args = (stop_ids.to(**dev), steps.to(**dev), min_tokens.to(**dev))
    for fn in (mask_stop_tokens, samp_ref.mask_stop_tokens_ref):
        src = logits.clone()
        out = fn(src, *args, inplace=inplace)
        assert torch.equal(out, expected), fn.__name__
        assert (out.data_ptr() == src.data_ptr()) == inplace
        if not inplace:
            assert torch.equal(src, logits)  # the caller's logits are left as they were


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v", big([(1, 128256), (5, 128256), (9, 5000), (3, 2048)],
                                    [(1, 5000), (5, 2049), (3, 300)]))
def test_argmax_matches_torch(K, dtype, n, v):
    """The speculative iteration's greedy argmax: the first index of each row's maximum, as
    torch.argmax, with ties across chunks, a row of -inf but one entry, and a NaN."""
    g = _gen(71 + n)
    logits = torch.randn(n, v, generator=g)
    logits[0, [v // 3, v - 1, 5]] = 50.0  # a three-way tie: the first index wins
    if n > 1:
        logits[1] = float("-inf")
        logits[1, v - 2] = -3.0
    if n > 2:
        logits[2, v // 2] = float("nan")
    x = logits.to(DEV, dtype)
    out = K.st.argmax(x)
    assert out.dtype == torch.int64
    assert torch.equal(out.cpu(), x.cpu().argmax(-1))
    assert out[0].item() == 5


def _noise_hitting_one(v: int) -> tuple[int, int, int]:
    """A (seed, step) whose uniform noise rounds to 1.0 at some index (its Gumbel noise is +inf),
    and that index."""
    for step in range(4000):
        u = samp_ref.uniform_noise(torch.tensor([7]), torch.tensor([step]), v)[0]
        hit = (u == 1.0).nonzero()
        if len(hit):
            return 7, step, int(hit[0])
    raise AssertionError("no noise of 1.0 in 4000 steps")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (5, 1.0), (-1, 0.9)])
def test_masked_tokens_stay_out_under_infinite_noise(K, top_k, top_p):
    """A token masked to -inf (a grammar, a min_tokens stop id) is never drawn, even where its
    noise is +inf: -inf + inf is NaN, which an argmax would take."""
    v = 49152
    seed, step, hit = _noise_hitting_one(v)
    logits = torch.full((2, v), float("-inf"))
    allowed = [(hit + 17 * j) % v for j in range(1, 11)]
    logits[:, allowed] = torch.randn(2, 10, generator=_gen(3))
    args = (logits.to(DEV), torch.tensor([1.0, 0.7], device=DEV),
            torch.full((2,), top_k, device=DEV), torch.full((2,), top_p, device=DEV),
            torch.full((2,), seed, device=DEV), torch.full((2,), step, device=DEV))
    for out in (samp_ref.sample_ref(*args), K.ops.sample(*args)):
        assert set(out.tolist()) <= set(allowed), (out.tolist(), hit)
