"""The engine's behaviour on CPU: API, bad inputs, finishes, batch invariance, async == sync."""
import random

import numpy as np
import pytest
import torch

from graphexec import Engine, LLM, RequestOutput, SamplingParams


def _prompts(n, seed=0, lo=1, hi=40, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine, reqs):
    """reqs: list of (id, prompt, params). Returns {id: final output}; checks streaming."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    final, seen = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            prev = seen.get(out.request_id, [])
            assert out.token_ids == prev + out.new_token_ids  # cumulative and incremental agree
            seen[out.request_id] = out.token_ids
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
    return final


def test_bad_inputs_raise_and_engine_keeps_serving():
    engine = Engine("tiny", max_batch=4, num_kv_blocks=64, max_model_len=128)
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    cases = [
        (("empty", [], None), "prompt_token_ids"),
        (("long", [3] * 128, None), "max_model_len"),
        (("vocab", [3, 512], None), "512"),
        (("neg", [3, -1], None), "-1"),
        (("ok", [1, 2], None), "ok"),
        (("", [1, 2], None), "request_id"),
        (("params", [1, 2], {"max_tokens": 3}), "params"),
        (("strprompt", "hello", None), "tokenizer"),
        # would index past the logits row on the device and take every request down with it
        (("stop", [1, 2], SamplingParams(stop_token_ids=[3, 512])), "stop_token_ids.*512"),
        (("floats", [1.0, 2.0], None), "prompt_token_ids.*ints"),
        (("float_array", torch.tensor([1.0, 2.0]), None), "prompt_token_ids.*ints"),
        (("matrix", torch.tensor([[1, 2]]), None), "prompt_token_ids.*Tensor"),
        (("bools", torch.tensor([True, False]), None), "prompt_token_ids.*ints"),
        # a device tensor would be read with a host sync (meta stands in for CUDA here)
        (("device", torch.tensor([1, 2], device="meta"), None), "prompt_token_ids.*meta"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args)
    with pytest.raises(ValueError, match="nope"):
        engine.abort("nope")
    out = run_engine(engine, [])
    assert out["ok"].finish_reason == "length" and len(out["ok"].token_ids) == 5


def test_prompts_as_int_arrays_equal_lists():
    """A 1-D numpy array or tensor of token ids is the same prompt as the list."""
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = [5, 9, 200, 31]
    ref = run_engine(Engine("tiny"), [("l", prompt, params)])["l"].token_ids
    for name, arr in (("np", np.array(prompt, dtype=np.int64)),
                      ("np32", np.array(prompt, dtype=np.int32)), ("pt", torch.tensor(prompt))):
        assert run_engine(Engine("tiny"), [(name, arr, params)])[name].token_ids == ref, name


def test_top_k_covering_the_vocabulary_is_no_filter():
    engine = Engine("tiny", max_batch=4, num_kv_blocks=64)
    sampled = dict(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    out = run_engine(engine, [("all", [4, 5, 6], SamplingParams(top_k=10**6, **sampled)),
                              ("off", [4, 5, 6], SamplingParams(top_k=-1, **sampled))])
    assert out["all"].token_ids == out["off"].token_ids
    assert engine.requests == {}


def test_request_larger_than_kv_cache_is_rejected():
    engine = Engine("tiny", max_batch=2, num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="needs 4 KV blocks, the cache has 2"):
        engine.add_request("big", [3] * 40)
    # The prompt fits but its output would outgrow the cache: alone, it could never finish.
    with pytest.raises(ValueError, match="max_tokens=30"):
        engine.add_request("grows", [3] * 10, SamplingParams(max_tokens=30))
    engine.add_request("fits", [3] * 10, SamplingParams(max_tokens=22, ignore_eos=True))
    out = run_engine(engine, [])
    assert out["fits"].finish_reason == "length" and len(out["fits"].token_ids) == 22


@pytest.mark.parametrize("opt,val", [("dtype", "int8"), ("max_batch", 0), ("block_size", -1),
                                     ("cuda_graphs", True), ("num_kv_blocks", 0),
                                     ("projections", "cutlass"), ("batch_invariant", True)])
def test_bad_engine_options(opt, val):
    with pytest.raises(ValueError, match=opt):
        Engine("tiny", device="cpu", **{opt: val})


def test_unknown_model():
    with pytest.raises(ValueError, match="no-such-model"):
        Engine("no-such-model")


def test_finish_reasons_stop_length_and_min_tokens():
    llm = LLM("tiny", max_batch=4, num_kv_blocks=64)
    prompt = _prompts(1, seed=3)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    toks = free[0].token_ids
    stop_at = toks[5]
    first = toks.index(stop_at)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == toks[:first + 1]
    # min_tokens suppresses the stop id on the device: the output must differ there.
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop_at],
                                                 min_tokens=first + 2))[0]
    assert stop_at not in out.token_ids[:first + 2]
    assert len(out.token_ids) >= first + 2


def test_context_limit_finishes_with_length():
    llm = LLM("tiny", max_batch=2, num_kv_blocks=64, max_model_len=40)
    out = llm.generate([[3] * 30], SamplingParams(max_tokens=100, temperature=0,
                                                   ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=16, temperature=0.9, top_k=40,
                                                   top_p=0.9, seed=7, ignore_eos=True)])
def test_batch_invariance(params):
    llm = LLM("tiny", max_batch=8, num_kv_blocks=128)
    prompts = _prompts(8, seed=1)
    alone = llm.generate([prompts[3]], params)[0].token_ids
    batched = llm.generate(prompts, params)[3].token_ids
    assert alone == batched
    assert len(set(alone)) > 4


def test_unseeded_requests_differ_and_engine_seed_reproduces():
    p = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = LLM("tiny", seed=1).generate([[5, 6]] * 2, p)
    b = LLM("tiny", seed=1).generate([[5, 6]] * 2, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids != a[1].token_ids


def test_logprobs_are_consistent():
    llm = LLM("tiny", max_batch=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, logprobs=3,
                                                   ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        best = max(lp.top.values())
        assert lp.logprob == pytest.approx(best, abs=1e-5)  # greedy picks the top token
        assert all(v <= 0 for v in lp.top.values())


def _mixed_requests(n, seed):
    rng = random.Random(seed)
    reqs = []
    for i, prompt in enumerate(_prompts(n, seed=seed, hi=60)):
        kind = i % 3
        params = SamplingParams(
            max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5,
            temperature=0.0 if kind == 0 else 0.8, top_k=20 if kind == 2 else -1,
            top_p=0.9 if kind == 2 else 1.0, seed=i if kind else None,
            logprobs=2 if i % 4 == 0 else None)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].token_ids == b[k].token_ids, k
        assert a[k].finish_reason == b[k].finish_reason, k
        if a[k].logprobs is not None:
            assert [x.token_id for x in a[k].logprobs] == [x.token_id for x in b[k].logprobs]


def test_async_equals_sync_mixed_batch():
    reqs = _mixed_requests(20, seed=5)
    sync = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256, async_scheduling=False),
                      reqs)
    engine = Engine("tiny", max_batch=8, num_kv_blocks=256, async_scheduling=True)
    asyn = run_engine(engine, reqs)
    _same(sync, asyn)
    assert sum(len(o.token_ids) for o in sync.values()) > 100
    # every launch took one result slot and published into the one the counter pointed at
    ring = engine.runner.results
    assert int(ring.counter) == ring.launched == engine.stats.steps


def test_eviction_under_kv_pressure_gives_the_same_tokens():
    reqs = [(rid, p, SamplingParams(max_tokens=40, temperature=0 if i % 2 else 0.7, seed=i,
                                    ignore_eos=True))
            for i, (rid, p, _) in enumerate(_mixed_requests(8, seed=9))]
    ample = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256, block_size=4), reqs)
    for mode in (False, True):
        tight = Engine("tiny", max_batch=8, num_kv_blocks=30, block_size=4,
                       async_scheduling=mode)
        _same(ample, run_engine(tight, reqs))
        assert tight.scheduler.stats.evictions > 0
        assert tight.pool.num_free == tight.pool.num_blocks


def test_abort_running_and_waiting():
    engine = Engine("tiny", max_batch=1, num_kv_blocks=64)
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("a", [3, 4, 5], p)
    engine.add_request("b", [3, 4, 6], p)
    engine.step()
    engine.step()
    engine.abort("a")  # running, possibly inside a launched step
    engine.abort("b")  # still waiting: max_batch is 1
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["a"].finish_reason == "abort" and outs["b"].finish_reason == "abort"
    assert outs["b"].token_ids == []
    assert engine.pool.num_free == engine.pool.num_blocks
    with pytest.raises(ValueError):
        engine.abort("a")


def test_streamed_outputs_are_snapshots():
    """Each step's output shows the tokens (and logprobs) as of that step, also after the
    request has grown: outputs read the request's lists up to their length at the step."""
    engine = Engine("tiny", max_batch=2, num_kv_blocks=32)
    engine.add_request("a", _prompts(1, seed=5)[0],
                       SamplingParams(max_tokens=9, logprobs=1, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    total = 0
    for out in seen:
        total += len(out.new_token_ids)
        assert len(out.token_ids) == len(out.logprobs) == total
        assert out.token_ids[-len(out.new_token_ids):] == out.new_token_ids or not out.new_token_ids
    assert total == 9 and seen[-1].finished and not seen[0].finished
    # equality is by content as of the step, like outputs built from plain lists
    first = seen[0]
    assert first != seen[-1]
    assert first == RequestOutput(first.request_id, first.prompt_token_ids, first.token_ids,
                                  first.new_token_ids, None, first.logprobs)


def test_close_frees_the_engine_and_refuses_further_use():
    import weakref

    with LLM("tiny", num_kv_blocks=64) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
        kv = weakref.ref(llm.engine.kv.k[0])
        llm.engine.add_request("left", [1, 2, 3], SamplingParams(max_tokens=50))
        llm.engine.step()  # running, not finished: close drops it
    assert len(out[0].token_ids) == 3
    engine = llm.engine
    assert kv() is None, "the KV cache outlived close()"
    assert not engine.has_unfinished()
    for call in (lambda: engine.step(), lambda: engine.abort("left"),
                 lambda: engine.add_request("x", [1], SamplingParams())):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    engine.close()  # idempotent


def test_generate_takes_arrays_of_prompts():
    params = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM("tiny")
    ref = [o.token_ids for o in llm.generate([[5, 9, 200], [7, 8, 9]], params)]
    assert [o.token_ids for o in llm.generate(np.array([[5, 9, 200], [7, 8, 9]]), params)] == ref
    assert llm.generate(torch.tensor([5, 9, 200]), params)[0].token_ids == ref[0]
    assert llm.generate([np.int64(5), np.int32(9), np.int64(200)], params)[0].token_ids == ref[0]
