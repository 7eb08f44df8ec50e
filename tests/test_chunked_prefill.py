"""Chunked prefill under a per-step token budget (max_num_batched_tokens): prompts longer than the
budget are prefilled over several steps while the batch decodes on. The oracle is the same
requests prefilled whole (a budget larger than any prompt), in sync mode."""
import random

import pytest
import torch

from graphexec import Engine, SamplingParams, SpeculativeConfig
from graphexec.request import Status
from test_engine import _same, run_engine

CUDA = torch.cuda.is_available()


def _long_requests(n: int, seed: int, lo: int = 1, hi: int = 300, max_tokens: int = 24):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randint(lo, hi))]
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens),
                                temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i,
                                ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
        out.append((f"r{i}", prompt, params))
    return out


def _engine(async_scheduling: bool, budget: int, **kw) -> Engine:
    opts = dict(max_batch=6, num_kv_blocks=256, max_model_len=1024, seed=1,
                async_scheduling=async_scheduling, max_num_batched_tokens=budget)
    opts.update(kw)
    return Engine("tiny", **opts)


@pytest.mark.parametrize("budget", [16, 40, 100])
def test_chunked_async_equals_whole_prompt_sync(budget):
    reqs = _long_requests(14, seed=budget)
    whole = run_engine(_engine(False, 4096), reqs)
    chunked = _engine(True, budget)
    _same(whole, run_engine(chunked, reqs))
    assert chunked.scheduler.stats.prefill_chunks > 0
    assert chunked.pool.num_free == chunked.pool.num_blocks


def test_chunked_speculative_equals_whole_prompt_sync():
    reqs = _long_requests(8, seed=3)
    spec = dict(speculative=SpeculativeConfig("self:1", 2))
    whole = run_engine(_engine(False, 4096, **spec), reqs)
    chunked = _engine(True, 24, **spec)
    _same(whole, run_engine(chunked, reqs))
    assert chunked.scheduler.stats.prefill_chunks > 0


def test_decoding_rows_get_a_token_every_step_while_a_long_prompt_prefills():
    engine = _engine(False, 64)
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("short", [5, 6, 7], p)
    engine.step()  # admitted: prefill + first decode step
    engine.add_request("long", list(range(2, 402)), p)
    steps_until_first = 0
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps_until_first += 1
        assert len(outs["short"].new_token_ids) == 1  # never held back by the prefill
        if "long" in outs:
            break
        assert engine.requests["long"].status is Status.PREFILLING
    # at most 64 tokens a step, one of them the decoding row's: 400 prompt tokens take at
    # least 7 steps, each but the last a chunk that ends no prompt
    assert steps_until_first >= 7
    assert engine.scheduler.stats.prefill_chunks == steps_until_first - 1
    # the prompt prefilled in chunks gives the tokens it gives prefilled whole
    whole = _engine(False, 4096)
    alone = run_engine(whole, [("long", list(range(2, 402)), p)])
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final["long"].token_ids == alone["long"].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_in_the_middle_of_a_prefill_frees_its_blocks(async_scheduling):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    others = [("a", [3, 4, 5], p), ("b", list(range(10, 60)), p)]
    alone = run_engine(_engine(False, 4096), others)
    engine = _engine(async_scheduling, 32)
    engine.add_request("long", list(range(2, 500)), p)
    engine.step()
    engine.step()
    assert engine.requests["long"].status is Status.PREFILLING
    assert engine.requests["long"].num_computed > 0
    engine.abort("long")
    done = run_engine(engine, others)
    assert done["long"].finish_reason == "abort" and not done["long"].token_ids
    _same(alone, {k: done[k] for k in alone})
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.prefilling


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefilling_request_is_evicted_under_kv_pressure_and_recomputed(async_scheduling):
    """Rows decoding into new blocks while a later, long prompt holds blocks: the later
    arrival gives its blocks back (recompute) before any decoding row is paused."""
    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reqs = [(f"d{i}", [7 + i] * 30, p) for i in range(3)]
    reqs.append(("long", list(range(2, 150)), SamplingParams(max_tokens=4, temperature=0,
                                                             ignore_eos=True)))
    ample = run_engine(_engine(False, 4096, block_size=4), reqs)
    tight = _engine(async_scheduling, 16, block_size=4, num_kv_blocks=64)
    _same(ample, run_engine(tight, reqs))
    assert tight.scheduler.stats.prefill_evictions > 0
    assert tight.pool.num_free == tight.pool.num_blocks


def test_max_num_batched_tokens_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine("tiny", max_num_batched_tokens=0)
    # decode rows take their tokens first: a budget the batch can fill leaves prompts none
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be larger than "
                                         "max_batch=8"):
        Engine("tiny", max_batch=8, max_num_batched_tokens=8)
    Engine("tiny", max_batch=8, max_num_batched_tokens=8,
           speculative=SpeculativeConfig("self:1", 2))  # 64 prompt tokens a step at least


def _gpu_engine(async_scheduling: bool, budget: int, **kw) -> Engine:
    opts = dict(device="cuda", buckets=[1, 2, 4, 8], max_batch=8)
    opts.update(kw)
    return _engine(async_scheduling, budget, **opts)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,budget", [("float32", 48), ("bfloat16", 256)])
def test_prefill_graphs_equal_eager_and_async_equals_sync(dtype, budget):
    """Captured prefills (padded to a token bucket) against eager ones at exact sizes, and
    async against sync, both with graphs and the same budget."""
    reqs = _long_requests(16, seed=7)
    eager = run_engine(_gpu_engine(False, budget, dtype=dtype, cuda_graphs=False), reqs)
    sync_g = _gpu_engine(False, budget, dtype=dtype, cuda_graphs=True)
    assert sync_g.runner.graphs.prefill
    graphs = run_engine(sync_g, reqs)
    async_g = _gpu_engine(True, budget, dtype=dtype, cuda_graphs=True)
    _same(graphs, run_engine(async_g, reqs))
    if dtype == "float32":
        _same(eager, graphs)
    assert async_g.scheduler.stats.prefill_chunks > 0
    assert async_g.pool.num_free == async_g.pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_batch_invariant_chunked_async_equals_whole_prompt_sync_in_bf16():
    """With batch-invariant kernels a position's KV and logits do not depend on the chunk it
    was prefilled in, so bf16 chunked async equals bf16 whole-prompt sync bit for bit."""
    reqs = _long_requests(12, seed=2, hi=600)
    opts = dict(dtype="bfloat16", batch_invariant=True, cuda_graphs=True)
    whole = run_engine(_gpu_engine(False, 2048, **opts), reqs)
    chunked = _gpu_engine(True, 64, **opts)
    _same(whole, run_engine(chunked, reqs))
    assert chunked.scheduler.stats.prefill_chunks > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_admissions_and_chunks_have_no_hidden_sync():
    """Requests arriving while the batch decodes: their chunked prefills are graph replays fed
    by non-blocking copies, so no step waits for the device."""
    engine = _gpu_engine(True, 64, cuda_graphs=True, num_kv_blocks=512)
    p = SamplingParams(max_tokens=80, temperature=0.7, seed=1, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"warm{i}", [3 + i] * 100, p)
    for _ in range(10):
        engine.step()
    breaks = engine.stats.chain_breaks
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(30):
            if i % 6 == 0:
                engine.add_request(f"new{i}", [11 + i] * (40 + 7 * i), p)
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.stats.chain_breaks == breaks
    assert engine.scheduler.stats.prefill_chunks > 0


def test_pack_prefill_lays_out_every_field():
    from graphexec.capture.prefill import PrefillMeta, pack_prefill
    from graphexec.plan import PrefillChunk

    bs, scratch, inert, cols = 4, 99, 7, 3
    # a middle chunk (no row: samples nothing), a prompt's last chunk, an evicted request's
    # recompute (resumes from its last token), then padding to 12 tokens and 5 sequences
    chunks = [PrefillChunk([11, 12, 13], start=2, blocks=[5, 6]),
              PrefillChunk([21, 22], start=0, blocks=[8], row=1, step=0),
              PrefillChunk([31], start=4, blocks=[2, 3], row=4, step=3, resume_token=77)]
    buf = torch.from_numpy(pack_prefill(chunks, 12, 5, cols, bs, scratch, inert))
    m = PrefillMeta.view(buf, 12, 5, cols)
    assert m.ids.tolist() == [11, 12, 13, 21, 22, 31] + [0] * 6
    assert m.positions.tolist() == [2, 3, 4, 0, 1, 4] + [0] * 6
    # position p of a chunk lives in slot blocks[p // bs] * bs + p % bs
    assert m.slots.tolist() == [22, 23, 24, 32, 33, 12] + [scratch * bs] * 6
    assert m.cu_seqlens.tolist() == [0, 3, 5, 6, 6, 6]
    assert m.seq_lens.tolist() == [5, 2, 5, 0, 0]
    assert m.rows.tolist() == [inert, 1, 4, inert, inert]
    assert m.steps.tolist() == [0, 0, 3, 0, 0]
    assert m.samples.tolist() == [0, 1, 0, 0, 0]
    assert m.resume.tolist() == [0, 0, 77, 0, 0]
    assert m.next_position.tolist() == [0, 2, 5, 0, 0]
    assert m.block_tables.tolist() == [[5, 6, scratch], [8, scratch, scratch],
                                       [2, 3, scratch]] + [[scratch] * cols] * 2
    with pytest.raises(RuntimeError, match="exceed"):
        pack_prefill(chunks, 5, 5, cols, bs, scratch, inert)
    with pytest.raises(RuntimeError, match="blocks for"):
        pack_prefill([PrefillChunk([1] * 5, start=0, blocks=[5])], 12, 5, cols, bs, scratch,
                     inert)
