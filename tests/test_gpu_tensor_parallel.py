"""Tensor parallelism on two GPUs (NCCL, bf16, CUDA graphs): what tests/test_tensor_parallel.py
checks on the CPU with gloo, where the oracles are exact, here with the bf16 tolerances of
tests/test_hf_parity.py. Skipped unless two CUDA devices are visible."""
import pytest
import torch

from graphexec import Engine, SamplingParams
from test_engine import _mixed_requests, _same, run_engine
from test_hf_parity import _graphexec_prefill_logits
from tp_helpers import PROMPTS, engine_in_a_process, on_every_rank, sharded_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

CUDA = torch.device("cuda", 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_sharded_bf16_logits_as_close_to_fp32_as_one_rank(hf_dirs_moderate):
    """Over the default all-reduce (the Triton kernel) both ranks see the same logits, and splitting the sums over two GPUs costs no
    more accuracy than bf16 itself: against the whole model in fp32 on the same GPU, size 2's
    error is within twice size 1's."""
    models = ["tiny", hf_dirs_moderate["qwen2"][0], hf_dirs_moderate["llama"][0]]
    ranks = sharded_logits(models, 2, CUDA, torch.bfloat16)
    for i, model in enumerate(models):
        assert torch.equal(ranks[0][i], ranks[1][i]), model
        exact = torch.cat(_graphexec_prefill_logits(model, CUDA, torch.float32, PROMPTS)).cpu()
        one = torch.cat(_graphexec_prefill_logits(model, CUDA, torch.bfloat16, PROMPTS)).cpu()
        assert _rel(ranks[0][i], exact) <= 2 * _rel(one, exact) + 1e-3, model


def test_sharded_bf16_logits_over_the_epilogue_fused_rows(hf_dirs_moderate):
    """A prefill of 40 tokens, inside the 33-64 rows where each rank runs the epilogue-fused
    projections (projections="auto", the default), the default all-reduce hands them its
    Normed rows, and the LM head lands each rank's logits in the other's memory: both ranks
    see the same logits (each computed its own columns, and received the other's), within
    twice one rank's bf16 error of the fp32 model."""
    prompts = [[5 + (7 * i) % 300 for i in range(24)], [9 + (11 * i) % 300 for i in range(16)]]
    models = [hf_dirs_moderate["llama"][0], hf_dirs_moderate["qwen2"][0]]
    ranks = sharded_logits(models, 2, CUDA, torch.bfloat16, prompts, projections="auto")
    for i, model in enumerate(models):
        assert torch.equal(ranks[0][i], ranks[1][i]), model
        exact = torch.cat(_graphexec_prefill_logits(model, CUDA, torch.float32, prompts)).cpu()
        one = torch.cat(_graphexec_prefill_logits(model, CUDA, torch.bfloat16, prompts)).cpu()
        assert _rel(ranks[0][i], exact) <= 2 * _rel(one, exact) + 1e-3, model


def _logits_with_and_without_pushes(shard, device, models, prompts):
    """The 33-64-row prefill's logits: as shipped; with the all-reduce sending the partial sums
    (the reducer offering no push target); and with the NCCL all-gather after a cuBLAS LM head
    too (no gather target either). For each run: whether each all-reduce took pushed words, and how
    many LM heads returned the whole logits (kernels/gather_triton.py)."""
    from graphexec.kernels import Pushed, linear_fused_triton
    from graphexec.model.shard import Shard
    from graphexec.parallel import symmetric
    from tp_helpers import _logits_as_arrays

    seen: dict = {"pushed": [], "gathered": 0}
    original = {"all_reduce": Shard.all_reduce, "all_reduce_norm": Shard.all_reduce_norm}

    def spy(name):
        def call(self, t, *args, **kwargs):
            out = original[name](self, t, *args, **kwargs)
            if out is not None:  # the reduce that ran (a None hands it to all_reduce)
                seen["pushed"].append(isinstance(t, Pushed))
            return out
        return call

    head = linear_fused_triton.linear_gathered

    def spy_head(*args, **kwargs):
        out = head(*args, **kwargs)
        seen["gathered"] += out is not None
        return out

    Shard.all_reduce, Shard.all_reduce_norm = spy("all_reduce"), spy("all_reduce_norm")
    linear_fused_triton.linear_gathered = spy_head
    shipped = {"push": symmetric.TritonAllReduce.push,
               "gather": symmetric.TritonAllReduce.gather}
    runs = []
    for push, gather in ((True, True), (False, True), (False, False)):
        reducer = symmetric.TritonAllReduce
        reducer.push = shipped["push"] if push else (lambda self, slot: None)
        reducer.gather = shipped["gather"] if gather else (lambda self: None)
        seen["pushed"], seen["gathered"] = [], 0
        logits = _logits_as_arrays(shard, device, models, torch.bfloat16, prompts, "auto")
        runs.append((logits, seen["pushed"], seen["gathered"]))
    reducer.push, reducer.gather = shipped["push"], shipped["gather"]
    return runs


def test_pushed_partial_sums_and_landed_logits_match_the_collectives(hf_dirs_moderate):
    """At 33-64 rows o and down push their partial sums to the peer from their epilogue, and
    the LM head lands its logits in the peer's memory. Every all-reduce then takes pushed
    words, and the logits are the bits of the all-reduce that sends them itself (the same
    kernels, the same sums in the same order); with the NCCL all-gather after a cuBLAS LM head
    too, they agree within bf16 rounding (another GEMM kernel), and the ranks agree with each
    other in every run."""
    prompts = [[5 + (7 * i) % 300 for i in range(24)], [9 + (11 * i) % 300 for i in range(16)]]
    model = hf_dirs_moderate["llama"][0]
    ranks = on_every_rank(_logits_with_and_without_pushes, ([model], prompts), 2, CUDA)
    for runs in ranks:
        (shipped, pushed, gathered), (no_push, sent, gathered_too), (nccl, _, none) = runs
        assert pushed and all(pushed) and sent and not any(sent)
        assert gathered == gathered_too == 1 and none == 0
        assert all((a == b).all() for a, b in zip(shipped, no_push))
        for a, b in zip(shipped, nccl):
            a, b = torch.from_numpy(a), torch.from_numpy(b)
            assert _rel(a, b) <= 1e-2 and not torch.equal(a, torch.zeros_like(a))
    for run in range(3):
        assert all((a == b).all() for a, b in zip(ranks[0][run][0], ranks[1][run][0]))


def test_sharded_bf16_logits_match_transformers(hf_dirs_moderate):
    """The HF parity test at size 2: the checkpoint's fp32 logits in transformers."""
    for arch in ("llama", "qwen2", "qwen3"):
        path, hf = hf_dirs_moderate[arch]
        hf = hf.to("cuda", torch.float32)
        ours = sharded_logits([path], 2, CUDA, torch.bfloat16)[0][0]
        start = 0
        for p in PROMPTS:
            with torch.no_grad():
                ref = hf(torch.tensor([p], device="cuda")).logits[0].float().cpu()
            mine = ours[start:start + len(p)]
            start += len(p)
            assert _rel(mine, ref) < 2e-2, f"{arch}: relative error {_rel(mine, ref):.2e}"


@pytest.mark.parametrize("projections", ["auto", "cublas"])
def test_async_graphs_equal_sync_at_size_2(monkeypatch, projections):
    """The host loop one step ahead of two GPUs gives what reading every step gives, token for
    token and bit for bit (both runs replay the same graphs). Over NCCL (captured in the
    graphs), the all-reduce of every engine after a process's first: engines here run in the
    test's process, which must not map symmetric memory before the last test of this file."""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "nccl")
    reqs = _mixed_requests(16, seed=5)
    opts = dict(device="cuda", dtype="bfloat16", max_batch=16, num_kv_blocks=512,
                buckets=[1, 2, 4, 8, 16], tensor_parallel_size=2, projections=projections)
    with Engine("tiny", async_scheduling=False, **opts) as sync:
        want = run_engine(sync, reqs)
    with Engine("tiny", async_scheduling=True, **opts) as eng:
        got = run_engine(eng, reqs)
        breaks = eng.stats_summary()["chain_breaks"]
    _same(want, got)
    assert breaks == 0


def test_greedy_at_size_2_mostly_agrees_with_size_1_in_bf16(monkeypatch):
    """bf16 sums in another order may flip a near-tie, after which a greedy stream goes its own
    way; the first tokens of most streams must still agree. (NCCL: in the test's process, as
    above.)"""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "nccl")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5 + 7 * i, 40, 3 * i + 1, 250, 17] for i in range(12)]
    outs = {}
    for size in (1, 2):
        with Engine("tiny", device="cuda", dtype="bfloat16", max_batch=16, num_kv_blocks=512,
                    tensor_parallel_size=size) as eng:
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            done = {}
            while eng.has_unfinished():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = o.token_ids
            outs[size] = done
    first = sum(outs[1][r][:4] == outs[2][r][:4] for r in outs[1])
    assert first >= 10, (outs[1], outs[2])


def _reduce_both_ways(shard, device, shapes):
    """This rank's operand (seeded by rank) and what each path makes of it: the symmetric
    one-shot (eager, and replayed from a CUDA graph) and NCCL."""
    import torch.distributed as dist

    out = []
    for i, shape in enumerate(shapes):
        gen = torch.Generator(device=device).manual_seed(100 * i + shard.rank)
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
        fits = shard.reducer.fits(x)
        eager = shard.all_reduce(x.clone(), 0)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = shard.all_reduce(static, 1)  # the replay follows the eager call
        static.copy_(x)
        graph.replay()
        nccl = x.clone()
        dist.all_reduce(nccl, group=shard.group)
        torch.cuda.synchronize()
        out.append((fits, x.cpu(), eager.cpu(), captured.cpu(), nccl.cpu()))
    return type(shard.reducer).__name__, out


def test_symmetric_all_reduce_equals_nccl_eager_and_in_a_graph(monkeypatch):
    """The one-shot reducer (GRAPHEXEC_ALL_REDUCE=triton) sums what NCCL sums, bit for bit at
    two ranks (one rounding of the same exact sum), also replayed from a captured graph; a
    message over its size limit goes to NCCL."""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    shapes = [(1, 4096), (64, 4096), (7, 2048), (1024, 4096)]  # the last one: 8 MiB, NCCL
    reducers, ranks = zip(*on_every_rank(_reduce_both_ways, (shapes,), 2, CUDA))
    assert reducers == ("TritonAllReduce", "TritonAllReduce")
    for i, shape in enumerate(shapes):
        fits, x0, eager, captured, nccl = ranks[0][i]
        x1 = ranks[1][i][1]
        assert fits == (i < 3), shape
        want = (x0.float() + x1.float()).to(torch.bfloat16)
        for got in (eager, captured, nccl, ranks[1][i][2]):
            assert torch.equal(got, want), shape


def _reduce_and_norm_both_ways(shard, device, shapes):
    """This rank's operand (seeded by rank), the residual and norm weight (the same on every
    rank), and what the fused all-reduce + add + norm makes of them (eager, and replayed from a
    graph) beside NCCL's sum followed by the Triton norm kernel."""
    import torch.distributed as dist

    from graphexec.kernels.norm_rope_triton import add_rms_norm

    out = []
    for i, (rows, d) in enumerate(shapes):
        gen = torch.Generator(device=device).manual_seed(100 * i + shard.rank)
        x = torch.randn(rows, d, device=device, dtype=torch.bfloat16, generator=gen)
        gen.manual_seed(7 + i)
        residual = 4 * torch.randn(rows, d, device=device, dtype=torch.bfloat16, generator=gen)
        weight = 0.5 + torch.rand(d, device=device, dtype=torch.bfloat16, generator=gen)
        eager = shard.all_reduce_norm(x.clone(), residual, weight, 1e-5, 0)
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = shard.all_reduce_norm(static, residual, weight, 1e-5, 1)
        static.copy_(x)
        graph.replay()
        nccl = x.clone()
        dist.all_reduce(nccl, group=shard.group)
        separate = add_rms_norm(nccl, residual, weight, 1e-5)
        torch.cuda.synchronize()
        out.append([(t.x.cpu(), t.summed.cpu()) for t in (eager, captured)]
                   + [tuple(t.cpu() for t in separate)])
    return out


def test_triton_all_reduce_with_the_norm_equals_nccl_then_the_norm(monkeypatch):
    """The all-reduce that ends in the residual add and RMSNorm (Shard.all_reduce_norm over the
    Triton reducer), eager and replayed: the residual stream bit for bit as NCCL's sum plus
    the residual, the normed rows within one bf16 rounding of the norm kernel's (the squares
    are summed in another order), and the same bits on both ranks."""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    # (3, 1000): rows of 500 words, whose pushes cannot all be 16-byte stores
    shapes = [(1, 4096), (64, 4096), (7, 2048), (2, 8192), (3, 1000)]
    ranks = on_every_rank(_reduce_and_norm_both_ways, (shapes,), 2, CUDA)
    for i, shape in enumerate(shapes):
        (want_normed, want_summed) = ranks[0][i][2]
        assert torch.equal(ranks[1][i][2][1], want_summed), shape
        ulp = 2 ** -7 * want_normed.float().abs().clamp_min(1e-3)
        for rank in (0, 1):
            for normed, summed in ranks[rank][i][:2]:
                assert torch.equal(summed, want_summed), shape
                assert torch.equal(normed, ranks[0][i][0][0]), shape
                assert ((normed.float() - want_normed.float()).abs() <= ulp).all(), shape


def _reduce_a_forward_in_a_graph(shard, device, sites: int, replays: int):
    """A graph of `sites` all-reduces in a row, slots alternating as the model's o and down
    do, replayed with new operands: every replay's operands and sums."""
    static = [torch.zeros(1, 4096, device=device, dtype=torch.bfloat16) for _ in range(sites)]
    for i, x in enumerate(static):  # the eager warm-up also runs the sequence once
        shard.all_reduce(x, i % 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [shard.all_reduce(x, i % 2) for i, x in enumerate(static)]
    got = []
    for r in range(replays):
        gen = torch.Generator(device=device).manual_seed(1000 * r + shard.rank)
        mine = [torch.randn(1, 4096, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(sites)]
        for x, m in zip(static, mine):
            x.copy_(m)
        graph.replay()
        got.append(([m.cpu() for m in mine], [o.clone().cpu() for o in outs]))
    torch.cuda.synchronize()
    return type(shard.reducer).__name__, got


def test_triton_all_reduce_over_a_replayed_forward(monkeypatch):
    """64 all-reduces a replay, as a llama-8b forward makes, five replays back to back with
    no host wait between them: each sum is the two ranks' operands' exact sum, rounded once,
    on both ranks."""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    ranks = on_every_rank(_reduce_a_forward_in_a_graph, (64, 5), 2, CUDA)
    (kind0, got0), (kind1, got1) = ranks
    assert kind0 == kind1 == "TritonAllReduce"
    for (mine0, outs0), (mine1, outs1) in zip(got0, got1):
        for a, b, o0, o1 in zip(mine0, mine1, outs0, outs1):
            want = (a.float() + b.float()).to(torch.bfloat16)
            assert torch.equal(o0, want) and torch.equal(o1, want)


def test_async_graphs_equal_sync_at_size_2_with_the_triton_all_reduce(monkeypatch):
    """The engine test above with GRAPHEXEC_ALL_REDUCE=triton, each engine in a process of its
    own (a process maps symmetric memory for one engine only): async with graphs gives sync's
    tokens, 0 chain breaks, and both engines ran the Triton all-reduce."""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    reqs = _mixed_requests(16, seed=5)
    opts = dict(device="cuda", dtype="bfloat16", max_batch=16, num_kv_blocks=512,
                buckets=[1, 2, 4, 8, 16], tensor_parallel_size=2)
    want, _, sync_reducer = engine_in_a_process("tiny", dict(opts, async_scheduling=False),
                                                reqs)
    got, breaks, async_reducer = engine_in_a_process("tiny", dict(opts, async_scheduling=True),
                                                     reqs)
    _same(want, got)
    assert breaks == 0 and sync_reducer == async_reducer == "TritonAllReduce"


def test_a_second_engine_in_a_process_falls_back_to_nccl(monkeypatch):
    """A process maps symmetric memory once: the first size-2 engine here asks for the Triton
    all-reduce and gets it, the second gets NCCL (a second rendezvous never completed), and
    both give the same greedy tokens. (No other test maps symmetric memory in the test
    process: they run such engines and ranks in processes of their own.)"""
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [(f"r{i}", [5 + i, 40, 250, 17], params) for i in range(4)]
    opts = dict(device="cuda", dtype="bfloat16", max_batch=4, num_kv_blocks=128,
                buckets=[1, 2, 4], tensor_parallel_size=2)
    outs, reducers = [], []
    for _ in range(2):
        with Engine("tiny", **opts) as eng:
            reducers.append(type(eng.model.shard.reducer).__name__)
            outs.append(run_engine(eng, reqs))
    assert reducers == ["TritonAllReduce", "NoneType"]
    _same(outs[0], outs[1])
