"""A random program of arrivals, aborts and steps, driven through an async engine and a sync one
at once with a KV cache small enough that rows are paused and evicted. Async output must equal
sync output. Mid-run neither is a prefix of the other in general: the two engines pause rows at
different times (async reserves blocks for steps whose tokens it has not read), so a row may be
ahead in either one; what must hold is that they never disagree on a token both have."""
import random

import pytest
import torch

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from graphexec import SamplingParams
from graphexec.request import Status
from lifecycle_helpers import (check_blocks, check_inert_row, collect, drain, make_engine,
                               pad_like_graphs, random_params)


class AsyncEqualsSync(RuleBasedStateMachine):
    ENGINE = {}  # extra Engine options (the GPU variant sets device and graphs)
    SYNC_ENGINE: dict = {}  # extra options of one engine only (the chunked variant's budgets)
    ASYNC_ENGINE: dict = {}
    # 24 blocks of 16 hold one largest request (300 + 64 + K tokens) and little else, so most
    # programs pause rows and many evict; at 40 blocks sync evicted in none of 40 programs.
    KV_BLOCKS = 24
    # GPU variants keep their two engines across examples: capturing graphs for every example
    # would dominate the run, and an engine that survives many programs must end each one clean.
    REUSE: dict | None = None

    def __init__(self):
        super().__init__()
        cached = self.REUSE.get("engines") if self.REUSE is not None else None
        if cached is not None and all(_idle(e) for e in cached):
            self.sync, self.asyn = cached
        else:
            self.sync = make_engine(False, num_kv_blocks=self.KV_BLOCKS,
                                    **self.ENGINE, **self.SYNC_ENGINE)
            self.asyn = make_engine(True, num_kv_blocks=self.KV_BLOCKS,
                                    **self.ENGINE, **self.ASYNC_ENGINE)
            if self.REUSE is not None:
                self.REUSE["engines"] = (self.sync, self.asyn)
        self.out_sync: dict = {}
        self.out_async: dict = {}
        self.aborted: set[str] = set()
        self.count = 0
        self.prompts: list[list[int]] = []

    @rule(prompt_len=st.integers(1, 300), max_tokens=st.integers(1, 64), greedy=st.booleans(),
          seed=st.integers(0, 2**16))
    def add(self, prompt_len, max_tokens, greedy, seed):
        rng = random.Random(seed)
        prompt = [rng.randrange(2, 512) for _ in range(prompt_len)]
        params = random_params(rng, greedy, max_tokens)
        self._submit(prompt, params)

    def _submit(self, prompt, params):
        if params.uses_penalties:
            TALLY["penalised"] = TALLY.get("penalised", 0) + 1
        rid = f"r{self.count}"
        self.count += 1
        self.prompts.append(prompt)
        self.sync.add_request(rid, prompt, params)
        self.asyn.add_request(rid, prompt, params)

    @precondition(lambda self: self.count > 0)
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        live = [rid for rid in self.sync.requests if rid in self.asyn.requests
                and not self.sync.requests[rid].finished and not self.asyn.requests[rid].finished]
        if not live:
            return
        rid = live[pick % len(live)]
        for e, name in ((self.sync, "sync"), (self.asyn, "async")):
            if e.requests[rid].status is Status.PREFILLING:
                TALLY[f"{name}_aborted_prefilling"] = TALLY.get(
                    f"{name}_aborted_prefilling", 0) + 1
        self.sync.abort(rid)
        self.asyn.abort(rid)
        self.aborted.add(rid)

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            collect(self.sync.step(), self.out_sync)
            collect(self.asyn.step(), self.out_async)

    @invariant()
    def streams_agree(self):
        for rid, a in self.out_async.items():
            s = self.out_sync.get(rid)
            if s is None:
                continue  # sync has emitted nothing for it yet (paused, or its row is waiting)
            assert _agree(s.token_ids, a.token_ids), rid
            if a.finished and s.finished and rid not in self.aborted:
                assert (s.token_ids, s.finish_reason) == (a.token_ids, a.finish_reason), rid

    @invariant()
    def blocks_accounted(self):
        check_blocks(self.sync)
        check_blocks(self.asyn)

    def teardown(self):
        drain(self.sync, self.out_sync)
        drain(self.asyn, self.out_async)
        assert self.out_sync.keys() == self.out_async.keys()
        for rid, s in self.out_sync.items():
            a = self.out_async[rid]
            assert s.finished and a.finished, rid
            if rid in self.aborted:  # cut at the same host step, possibly after different counts
                assert _agree(s.token_ids, a.token_ids), rid
            else:
                assert (s.token_ids, s.finish_reason) == (a.token_ids, a.finish_reason), rid
        for e in (self.sync, self.asyn):
            assert e.pool.num_free == e.pool.num_blocks, "KV blocks leaked"
            assert not e.requests and not e.in_flight
        assert self.asyn.stats.chain_breaks == 0
        for e, name in ((self.sync, "sync"), (self.asyn, "async")):
            for k in ("pauses", "evictions", "prefill_chunks", "prefill_evictions",
                      "prefix_hit_tokens"):
                TALLY[f"{name}_{k}"] = TALLY.get(f"{name}_{k}", 0) + getattr(
                    e.scheduler.stats, k)


def _agree(x: list[int], y: list[int]) -> bool:
    n = min(len(x), len(y))
    return x[:n] == y[:n]


def _idle(engine) -> bool:
    return (not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_blocks
            and not engine.requests)


TALLY: dict[str, int] = {}  # across examples, printed by -s runs to show pressure happened


# Derandomized: CI runs the same programs every time, so a red run is reproducible and never
# spends minutes shrinking. Fresh programs: `make fuzz` (tools/fuzz_lifecycle.py).
AsyncEqualsSync.TestCase.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAsyncEqualsSync = AsyncEqualsSync.TestCase


def test_state_machine_hits_pauses_and_evictions():
    """The program above is only meaningful if KV pressure actually pauses and evicts rows."""
    TALLY.clear()
    from hypothesis.stateful import run_state_machine_as_test

    # Derandomized like the test above: a random draw of 10 programs sometimes evicted nothing.
    run_state_machine_as_test(AsyncEqualsSync, settings=settings(
        max_examples=10, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert all(TALLY.get(f"{e}_{k}", 0) > 0 for e in ("sync", "async")
               for k in ("pauses", "evictions")), TALLY
    assert TALLY.get("penalised", 0) > 0, TALLY


class ChunkedAsyncEqualsWholeSync(AsyncEqualsSync):
    """Async prefills prompts in chunks of a small budget; sync prefills each whole. Aborts,
    pauses and evictions then land in the middle of prefills too."""

    SYNC_ENGINE = dict(max_num_batched_tokens=4096)
    ASYNC_ENGINE = dict(max_num_batched_tokens=24)


def test_chunked_async_equals_whole_sync_with_aborts_pauses_evictions_mid_prefill():
    """The chunked program, checked as it runs; then that it was meaningful: prompts were cut,
    requests aborted while prefilling, rows paused and evicted. (An eviction landing exactly
    mid-prefill is rare at random: test_chunked_prefill.py forces one.)"""
    TALLY.clear()
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(ChunkedAsyncEqualsWholeSync, settings=settings(
        max_examples=20, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert all(TALLY.get(f"async_{k}", 0) > 0 for k in (
        "prefill_chunks", "aborted_prefilling", "evictions", "pauses")), TALLY


class GraphShapedAsyncEqualsWholeSync(ChunkedAsyncEqualsWholeSync):
    """The chunked program with async's mixed steps in the shapes the CUDA graphs run
    (capture/mixed.py: padded to a token bucket, unused decode places as the inert row),
    forced on the CPU. The inert row must stay inert through every pause, eviction and abort."""

    def __init__(self):
        super().__init__()
        pad_like_graphs(self.asyn)

    def teardown(self):
        super().teardown()
        check_inert_row(self.asyn)


def test_graph_shaped_mixed_steps_equal_whole_sync_with_aborts_pauses_evictions():
    TALLY.clear()
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(GraphShapedAsyncEqualsWholeSync, settings=settings(
        max_examples=10, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert all(TALLY.get(f"async_{k}", 0) > 0 for k in ("prefill_chunks", "pauses")), TALLY


# Prompts of the caching machine start with one of these, so later requests hit earlier blocks.
PREFIXES = [[random.Random(100 + i).randrange(2, 512) for _ in range(n)]
            for i, n in enumerate((40, 90, 170))]


class CachedAsyncEqualsUncachedSync(ChunkedAsyncEqualsWholeSync):
    """Async with prefix caching (and chunked prefill) against sync without either, on prompts
    that share prefixes, under the same KV pressure, aborts, pauses and evictions. At the end
    every cached block holds what a fresh prefill of its token chain writes."""

    ASYNC_ENGINE = dict(max_num_batched_tokens=24, enable_prefix_caching=True)

    @rule(which=st.integers(0, len(PREFIXES) - 1), suffix_len=st.integers(0, 60),
          max_tokens=st.integers(1, 64), greedy=st.booleans(), seed=st.integers(0, 2**16))
    def add_shared(self, which, suffix_len, max_tokens, greedy, seed):
        rng = random.Random(seed)
        suffix = [rng.randrange(2, 512) for _ in range(suffix_len)]
        self._submit(PREFIXES[which] + suffix, random_params(rng, greedy, max_tokens))

    def teardown(self):
        super().teardown()
        from test_prefix_caching import check_cached_blocks_hold_their_prefix

        TALLY["cached_blocks_checked"] = TALLY.get("cached_blocks_checked", 0) + (
            check_cached_blocks_hold_their_prefix(self.asyn, self.prompts))


def test_cached_async_equals_uncached_sync_under_pressure():
    """The caching program, checked as it runs; then that it was meaningful: prompts hit
    cached blocks while rows were paused and evicted, and cached blocks were left to check."""
    TALLY.clear()
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(CachedAsyncEqualsUncachedSync, settings=settings(
        max_examples=20, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert all(TALLY.get(f"async_{k}", 0) > 0 for k in (
        "prefix_hit_tokens", "evictions", "pauses", "prefill_chunks")), TALLY
    assert TALLY.get("cached_blocks_checked", 0) > 0, TALLY


class AsyncEqualsSyncOnGpu(AsyncEqualsSync):
    # Sync and async both replay graphs: async + graphs must equal sync + graphs.
    ENGINE = dict(device="cuda", cuda_graphs=True, dtype="float32", buckets=[1, 2, 4])
    REUSE = {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_state_machine_on_gpu_with_graphs():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(AsyncEqualsSyncOnGpu, settings=settings(
        max_examples=15, stateful_step_count=30, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))


# The tiny preset has no tokenizer: constrained rows run over a made-up vocabulary, JSON's
# characters and then runs of them, EOS spelled as a special token.
_CHARS = '{}[]:,"-.0123456789abcdefghijklmnopqrstuvwxyz '


def _tiny_vocab(size: int, eos: list[int]) -> list[str]:
    vocab = [_CHARS[i % len(_CHARS)] * (1 + i // len(_CHARS)) for i in range(size)]
    for t in eos:
        vocab[t] = f"<eos{t}>"
    return vocab


def _grammar_specs():
    from graphexec.structured import StructuredOutputsParams as S
    return [S(regex="[a-c]{1,6}-[0-9]{2}"), S(choice=["abc", "de", "fghij"]),
            S(json={"type": "object", "properties": {"a": {"type": "integer"}},
                    "required": ["a"]}), S(json_object=True)]


class ConstrainedAsyncEqualsSync(AsyncEqualsSync):
    """The plain program with grammar rows (structured outputs) among penalised and plain ones,
    under the same aborts, pauses and evictions: async equals sync, and every output, cut or
    whole, is a sentence of its grammar's prefix language (a fresh matcher accepts each token,
    EOS included, which it accepts only where the grammar may end)."""

    def __init__(self):
        super().__init__()
        from graphexec.structured import Grammars

        for e in (self.sync, self.asyn):
            eos = list(e.model_config.eos_token_ids)
            e._grammars = Grammars.for_vocab(_tiny_vocab(e.model_config.vocab_size, eos), eos)
        self.constrained: dict[str, object] = {}

    @rule(prompt_len=st.integers(1, 200), max_tokens=st.integers(1, 48),
          which=st.integers(0, 3), seed=st.integers(0, 2**16))
    def add_constrained(self, prompt_len, max_tokens, which, seed):
        rng = random.Random(seed)
        prompt = [rng.randrange(2, 512) for _ in range(prompt_len)]
        spec = _grammar_specs()[which]
        self.constrained[f"r{self.count}"] = spec
        self._submit(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=rng.choice([0.0, 0.9]), seed=seed,
            structured_outputs=spec, presence_penalty=rng.choice([0.0, 1.0])))

    def teardown(self):
        super().teardown()
        grammars = self.sync._grammars
        for rid, spec in self.constrained.items():
            matcher = grammars.matcher(spec)
            for t in self.out_sync[rid].token_ids:
                matcher.accept(t)
            assert matcher.rejected == 0, (rid, self.out_sync[rid].token_ids)
            key = f"constrained_{self.out_sync[rid].finish_reason}"
            TALLY[key] = TALLY.get(key, 0) + 1


def test_constrained_rows_async_equals_sync_under_pressure():
    pytest.importorskip("xgrammar")
    TALLY.clear()
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(ConstrainedAsyncEqualsSync, settings=settings(
        max_examples=8, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    assert TALLY.get("constrained_stop", 0) > 0 and TALLY.get("constrained_length", 0) > 0, TALLY
    assert TALLY.get("async_pauses", 0) + TALLY.get("async_evictions", 0) > 0, TALLY
