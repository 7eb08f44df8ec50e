"""Shared by the lifecycle tests: engines, random requests, and the invariants."""
import random
from collections import Counter

from graphexec import Engine, SamplingParams


def make_engine(async_scheduling: bool, **kw) -> Engine:
    opts = dict(max_batch=4, num_kv_blocks=40, block_size=16, max_model_len=512, seed=3)
    opts.update(kw)
    return Engine("tiny", async_scheduling=async_scheduling, **opts)


def pad_like_graphs(engine: Engine) -> None:
    """Makes a CPU engine run its mixed steps in the shapes CUDA graphs capture: over a static
    buffer padded to a token bucket (and 16 chunks), with a decode part of min(max_batch,
    bucket) places, those past the step's decode rows running as the inert row."""
    import torch

    from graphexec.capture.prefill import PrefillMeta
    from graphexec.plan import MAX_PREFILL_SEQS

    runner, budget = engine.runner, engine.config.max_num_batched_tokens
    runner.token_buckets = engine.config.token_buckets
    runner.prefill_buffer = torch.zeros(
        PrefillMeta.size(budget, MAX_PREFILL_SEQS, runner.state.max_cols), dtype=torch.int64)


def check_inert_row(engine: Engine) -> None:
    """The row every padding place runs as still holds token 0, position 0, step 0 and only
    the scratch block."""
    st = engine.runner.state
    row = st.inert_row
    assert int(st.input_ids[row]) == int(st.positions[row]) == int(st.steps[row]) == 0
    assert bool((st.block_tables[row] == st.scratch_block).all())


def random_params(rng: random.Random, greedy: bool, max_tokens: int) -> SamplingParams:
    stop = rng.sample(range(2, 512), 24) if rng.random() < 0.5 else []
    kw = dict(max_tokens=max_tokens, temperature=0.0 if greedy else 0.9,
              top_k=rng.choice([-1, 30]), top_p=rng.choice([1.0, 0.8]),
              seed=rng.randrange(1000) if rng.random() < 0.7 else None,
              stop_token_ids=stop, ignore_eos=rng.random() < 0.5,
              logprobs=rng.choice([None, 2]))
    if rng.random() < 0.4:  # a penalised row: its slot follows it everywhere
        kw.update(presence_penalty=rng.choice([0.0, 1.0]),
                  frequency_penalty=rng.choice([0.0, 0.5]),
                  repetition_penalty=rng.choice([1.0, 1.3]), min_p=rng.choice([0.0, 0.1]),
                  logit_bias=rng.choice([None, {rng.randrange(512): 5.0}]))
    return SamplingParams(**kw)


def check_blocks(engine: Engine) -> None:
    """free + used == total; every used block belongs to live requests or waits for a step
    still in flight, and its reference count is the number of those owners (a block shared by
    prefix caching has several); no block is both free and referenced."""
    pool, sched = engine.pool, engine.scheduler
    assert pool.num_free + pool.num_used == pool.num_blocks
    owners = Counter(b for r in engine.requests.values() for b in r.blocks)
    owners.update(b for _, blocks in sched.deferred for b in blocks)
    if not pool.enable_caching:
        assert max(owners.values(), default=1) == 1, "a block is owned twice"
    assert all(pool.refcount(b) == owners.get(b, 0) for b in range(pool.num_blocks))
    assert not set(pool._free) & set(owners), "a free block is referenced"
    assert pool.num_used == len(owners)
    if sched.deferred:
        oldest = min(s.plan.step_id for s in engine.in_flight) if engine.in_flight else None
        assert oldest is not None and all(sid >= oldest for sid, _ in sched.deferred)


def drain(engine: Engine, collected: dict, max_steps: int = 5000) -> None:
    """Steps until done; a livelock fails here instead of hanging the suite."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        collect(engine.step(), collected)
    raise AssertionError(f"no end after {max_steps} steps: {engine.stats_summary()}")


def collect(outputs, collected: dict) -> None:
    for o in outputs:
        prev = collected.get(o.request_id)
        if prev is not None:
            assert o.token_ids[:len(prev.token_ids)] == prev.token_ids
        collected[o.request_id] = o
