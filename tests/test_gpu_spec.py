"""Speculative decoding on the GPU with the iteration captured as graphs: greedy output equals
plain decoding, sync and async accept the same drafts, lifecycles keep working."""
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from graphexec import LLM, SamplingParams, SpeculativeConfig
from test_lifecycle_state_machine import AsyncEqualsSync, ConstrainedAsyncEqualsSync
from test_spec import GREEDY, PROMPTS, check_acceptance_parity

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# float32: the verify forward runs K+1 tokens per row where plain decode runs one, and in bf16
# the different GEMM shapes may round a near-tie differently; exactness is a float32 property.
GPU = dict(device="cuda", dtype="float32", max_batch=8, buckets=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def plain_greedy_gpu():
    return [o.token_ids for o in LLM("tiny", **GPU).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", ["self:2", "tiny"])
def test_greedy_speculative_graphs_equal_plain(plain_greedy_gpu, draft, k, async_scheduling):
    llm = LLM("tiny", async_scheduling=async_scheduling, cuda_graphs=True,
              speculative=SpeculativeConfig(draft, k), **GPU)
    assert llm.engine.runner.graphs is not None
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_greedy_gpu
    rate = sum(o.num_accepted_tokens for o in outs) / sum(o.num_drafted_tokens for o in outs)
    assert rate == 1.0 if draft == "self:2" else rate < 0.5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_self_draft_at_buckets_of_the_fused_projections(async_scheduling):
    """40 rows run the 48 bucket, where the default op set adds the residual in the o and down
    projections' epilogues and leaves the draft states' residual None: the verify must take
    them as they are (float32, where those ops fall back to torch, so greedy output equals
    plain decoding exactly)."""
    opts = dict(GPU, max_batch=64, buckets=[1, 2, 4, 8, 16, 32, 48, 64])
    prompts = [[random.Random(100 + i).randrange(2, 512) for _ in range(4 + i % 9)]
               for i in range(40)]
    plain = [o.token_ids for o in LLM("tiny", **opts).generate(prompts, GREEDY)]
    llm = LLM("tiny", async_scheduling=async_scheduling, cuda_graphs=True,
              speculative=SpeculativeConfig("self:2", 2), **opts)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == plain


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_hold_at_every_verified_position_at_batch_one(async_scheduling):
    """One request (bucket 1) whose stop ids are tokens plain decoding emits, held back by
    min_tokens: every verify row of the speculative step must see the request's own floor.
    (The verify's per-row copies of min_tokens were once a stride-0 view that the Triton stop
    mask read as a dense vector: rows 1..K took other rows' floors and let stop ids through.)"""
    prompt = PROMPTS[0]
    free = LLM("tiny", **GPU).generate([prompt], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True))[0].token_ids
    stops = sorted(set(free[1:8]))
    params = SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30,
                            stop_token_ids=stops, ignore_eos=True)
    plain = LLM("tiny", **GPU).generate([prompt], params)[0].token_ids
    assert len(plain) >= 30 and not set(plain[:30]) & set(stops)
    spec = LLM("tiny", async_scheduling=async_scheduling, cuda_graphs=True,
               speculative=SpeculativeConfig("self:2", 4), **GPU).generate([prompt], params)
    assert spec[0].token_ids == plain


@pytest.mark.parametrize("dtype,batch_invariant", [("float32", False), ("bfloat16", True)])
def test_acceptance_is_the_same_in_sync_and_async_on_gpu(dtype, batch_invariant):
    """bf16 needs the batch-invariant kernels: sync and async shrink the batch at different
    steps, and with batch-dependent kernels a row's logits would change with it."""
    rng = random.Random(5)
    check_acceptance_parity(
        [SamplingParams(max_tokens=rng.randint(5, 40), temperature=rng.choice([0, 0.8]),
                        top_p=rng.choice([1.0, 0.9]), seed=i, ignore_eos=True)
         for i in range(len(PROMPTS))],
        **dict(GPU, dtype=dtype, batch_invariant=batch_invariant))


class AsyncEqualsSyncSpeculativeOnGpu(AsyncEqualsSync):
    ENGINE = dict(device="cuda", cuda_graphs=True, dtype="float32", buckets=[1, 2, 4],
                  speculative=SpeculativeConfig("self:1", 3))
    REUSE = {}


def test_lifecycle_state_machine_with_speculation_on_gpu():
    run_state_machine_as_test(AsyncEqualsSyncSpeculativeOnGpu, settings=settings(
        max_examples=10, stateful_step_count=30, deadline=None, database=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))


class ConstrainedAsyncEqualsSyncSpeculativeOnGpu(ConstrainedAsyncEqualsSync):
    ENGINE = AsyncEqualsSyncSpeculativeOnGpu.ENGINE
    REUSE = {}


def test_constrained_lifecycle_state_machine_with_speculation_on_gpu():
    """Grammar rows among penalised and plain ones, graphs, aborts, pauses and evictions."""
    pytest.importorskip("xgrammar")
    run_state_machine_as_test(ConstrainedAsyncEqualsSyncSpeculativeOnGpu, settings=settings(
        max_examples=8, stateful_step_count=30, deadline=None, database=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bf16_self_draft_is_always_accepted_with_batch_invariant_kernels(async_scheduling):
    """bf16: the draft runs B rows, the verify B * (K + 1); with the default kernels those
    shapes round differently and a draft equal to the target is sometimes rejected. With the
    batch-invariant kernels every draft is accepted and the output equals plain decoding's."""
    opts = dict(GPU, dtype="bfloat16", batch_invariant=True, cuda_graphs=True,
                async_scheduling=async_scheduling)
    plain = [o.token_ids for o in LLM("tiny", **opts).generate(PROMPTS, GREEDY)]
    llm = LLM("tiny", speculative=SpeculativeConfig("self:2", 4), **opts)
    outs = llm.generate(PROMPTS, GREEDY)
    drafted = sum(o.num_drafted_tokens for o in outs)
    assert drafted > 0
    assert sum(o.num_accepted_tokens for o in outs) == drafted
    assert [o.token_ids for o in outs] == plain


class AsyncEqualsSyncSpeculativeBf16OnGpu(AsyncEqualsSync):
    # bf16 under KV pressure: the two engines' batches (and buckets) change at different steps
    # and rows pause, evict and re-prefill at different times; only kernels whose per-row
    # results ignore the batch, and whose prefill attends exactly like decode, keep them equal.
    ENGINE = dict(device="cuda", cuda_graphs=True, dtype="bfloat16", batch_invariant=True,
                  buckets=[1, 2, 4], speculative=SpeculativeConfig("self:1", 3))
    REUSE = {}


def test_bf16_lifecycle_state_machine_with_batch_invariant_kernels():
    run_state_machine_as_test(AsyncEqualsSyncSpeculativeBf16OnGpu, settings=settings(
        max_examples=10, stateful_step_count=30, deadline=None, database=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_penalised_rows_with_graphs_equal_plain(async_scheduling):
    """Penalties, logit bias and min_p at every verified position, captured: greedy output
    equals plain decoding's (float32), with the whole target as draft and a weak one."""
    from graphexec.plan import Variant
    from test_spec_controls import _greedy_penalised

    reqs = _greedy_penalised(12, seed=21)
    prompts = [p for _, p, _ in reqs]
    params = [sp for _, _, sp in reqs]
    plain = [o.token_ids for o in LLM("tiny", **GPU).generate(prompts, params)]
    for draft in ("self:2", "self:1"):
        llm = LLM("tiny", async_scheduling=async_scheduling, cuda_graphs=True,
                  speculative=SpeculativeConfig(draft, 3), **GPU)
        graphs = llm.engine.runner.graphs
        assert graphs.has(8, Variant(False, False, sampled=False, penalties=True))
        assert graphs.has(8, Variant(False, True, sampled=True, penalties=True, grammar=True))
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain, draft


def test_penalised_and_constrained_rows_async_graphs_equal_sync_eager():
    """Grammar rows (tiny's made-up vocabulary), penalised and plain rows, seeded and greedy:
    async with graphs equals sync eager token for token, and every constrained output is a
    sentence of its grammar."""
    pytest.importorskip("xgrammar")
    from graphexec import Engine
    from test_engine import _same, run_engine
    from test_spec_controls import _check_constrained, _mixed_batch, _tiny_grammars

    reqs = _mixed_batch(seed=32)
    spec = SpeculativeConfig("self:1", 3)
    runs = []
    for graphs, async_scheduling in ((False, False), (True, True)):
        engine = Engine("tiny", async_scheduling=async_scheduling, cuda_graphs=graphs,
                        speculative=spec, num_kv_blocks=256, max_num_batched_tokens=48,
                        **GPU)
        vocab = _tiny_grammars(engine)
        runs.append(run_engine(engine, reqs))
    _same(*runs)
    assert _check_constrained(engine, vocab, reqs, runs[1]) >= 3
