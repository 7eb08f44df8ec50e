"""On the GPU: graph replay == eager, async+graphs == sync, no hidden syncs, the staging race."""
import pytest
import torch

from graphexec import Engine, SamplingParams
from graphexec.capture.staging import H2DRing
from test_engine import _mixed_requests, _same, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUCKETS = [1, 2, 4, 8, 16]


def _engine(**kw):
    opts = dict(device="cuda", max_batch=16, num_kv_blocks=512, buckets=BUCKETS)
    opts.update(kw)
    return Engine("tiny", **opts)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_graph_replay_matches_eager_for_every_bucket(n):
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0, logprobs=5,
                                         ignore_eos=True))
            for i, (_, p, _) in enumerate(_mixed_requests(n, seed=n))]
    eager = run_engine(_engine(cuda_graphs=False, async_scheduling=False), reqs)
    graphs = run_engine(_engine(cuda_graphs=True, async_scheduling=False), reqs)
    for rid in eager:
        assert eager[rid].token_ids == graphs[rid].token_ids
        for a, b in zip(eager[rid].logprobs, graphs[rid].logprobs):
            assert abs(a.logprob - b.logprob) < 2e-2 * max(1.0, abs(a.logprob))


@pytest.mark.parametrize("dtype,projections", [("float32", "cublas"), ("bfloat16", "cublas"),
                                               ("bfloat16", "auto")])
def test_async_graphs_equal_sync(dtype, projections):
    reqs = _mixed_requests(24, seed=11)
    opts = dict(dtype=dtype, projections=projections)
    sync = run_engine(_engine(cuda_graphs=False, async_scheduling=False, **opts), reqs)
    sync_g = run_engine(_engine(cuda_graphs=True, async_scheduling=False, **opts), reqs)
    async_g = _engine(cuda_graphs=True, async_scheduling=True, **opts)
    out = run_engine(async_g, reqs)
    _same(sync_g, out)
    if dtype == "float32":
        _same(sync, out)
    assert async_g.pool.num_free == async_g.pool.num_blocks


@pytest.mark.parametrize("spec", [False, True])
def test_result_slots_follow_the_device_counter(spec):
    """Every launch takes one result slot and publishes its decode rows once, so the host's
    count of launches equals the device counter that picks the slot the GPU writes (async with
    graphs, a self-draft: several tokens a row, and steps that run prompt chunks alone); and
    the tokens read back equal sync mode's (fp32: a self-draft's bf16 kernels round by batch)."""
    from graphexec import SpeculativeConfig
    reqs = _mixed_requests(24, seed=5)
    opts = dict(cuda_graphs=True, dtype="float32")
    if spec:
        opts["speculative"] = SpeculativeConfig("self:1", 2)
    engine = _engine(async_scheduling=True, **opts)
    out = run_engine(engine, reqs)
    ring = engine.runner.results
    assert int(ring.counter) == ring.launched == engine.stats.steps > 0
    _same(run_engine(_engine(async_scheduling=False, **opts), reqs), out)


def test_steady_state_decode_has_no_hidden_sync():
    engine = _engine(cuda_graphs=True, async_scheduling=True)
    p = SamplingParams(max_tokens=200, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [3 + i] * 20, p)
    for _ in range(20):  # admissions, prefills and the first block reservations
        engine.step()
    breaks = engine.stats.chain_breaks
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.stats.chain_breaks == breaks


def test_staging_ring_survives_rewrite_while_copy_in_flight():
    """vLLM #24799: rewriting a pinned source right after enqueueing its non-blocking copy. A
    naive single buffer shows the corruption; the ring waits for the slot's event instead."""
    dev = torch.device("cuda")
    n = 1 << 16
    naive = torch.empty(n, dtype=torch.int64, pin_memory=True)
    naive.fill_(1)
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy has not run yet
    d_naive = naive.to(dev, non_blocking=True)
    naive.fill_(2)
    torch.cuda.synchronize()
    assert (d_naive == 2).any(), "race not reproduced: the copy ran before the rewrite"

    ring = H2DRing(dev, num_slots=2, capacity=n)
    torch.cuda._sleep(200_000_000)
    first, _ = ring.put([1] * n, [])
    for v in range(2, 6):  # wraps the ring twice: slot 0 is rewritten while its copy waits
        ring.put([v] * n, [])
    torch.cuda.synchronize()
    assert (first == 1).all()
    assert ring.stats.waits > 0


def test_fused_projection_buckets_graphs_equal_eager_and_async_equals_sync():
    """Buckets of 33-64 rows run the epilogue-fused projections (kernels/op_sets.py, FusedOps: o
    down adding the residual, gate_up the activation, a small qkv on Triton and the attention
    after it prefetching): greedy rows of the graphs equal the eager iterations token for token
    (as test_graph_replay_matches_eager_for_every_bucket checks for small buckets), and async
    mode equals sync in full (60 mixed requests at max_batch 64: the 64 and 48 buckets run,
    then smaller ones as requests finish)."""
    reqs = _mixed_requests(60, seed=5)
    opts = dict(dtype="bfloat16", projections="auto", max_batch=64, num_kv_blocks=1024,
                buckets=[1, 2, 4, 8, 16, 32, 48, 64])
    eager = run_engine(_engine(cuda_graphs=False, async_scheduling=False, **opts), reqs)
    sync_g = run_engine(_engine(cuda_graphs=True, async_scheduling=False, **opts), reqs)
    async_g = run_engine(_engine(cuda_graphs=True, async_scheduling=True, **opts), reqs)
    greedy = [rid for rid, _, p in reqs if p.temperature == 0.0]
    assert len(greedy) == 20
    _same({r: eager[r] for r in greedy}, {r: sync_g[r] for r in greedy})
    _same(sync_g, async_g)
