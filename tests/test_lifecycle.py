"""Targeted lifecycle cases (the list of Megatron-LM #4604), each run sync and async, async
checked against sync token for token, with the async chain never broken."""
import pytest

from graphexec import SamplingParams, SpeculativeConfig
from lifecycle_helpers import check_blocks, collect, drain, make_engine

G = dict(temperature=0.0, ignore_eos=True)


def run_pair(program, **engine_kw):
    """program(engine, step) drives one engine; returns sync and async outputs."""
    results = []
    for mode in (False, True):
        engine = make_engine(mode, **engine_kw)
        out: dict = {}

        def step(n=1):
            for _ in range(n):
                collect(engine.step(), out)
                check_blocks(engine)

        program(engine, step)
        drain(engine, out)
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.stats.chain_breaks == 0
        results.append((engine, out))
    (_, sync), (_, asyn) = results
    assert sync.keys() == asyn.keys()
    for rid in sync:
        s, a = sync[rid], asyn[rid]
        if s.finish_reason == "abort":  # async knew one step less when the abort came
            assert a.finish_reason == "abort" and s.token_ids[:len(a.token_ids)] == a.token_ids
        else:
            assert (s.token_ids, s.finish_reason) == (a.token_ids, a.finish_reason), rid
    return results


def test_finish_one_row_all_rows_and_mixed():
    def program(engine, step):
        for i, n in enumerate([3, 9, 9, 20]):
            engine.add_request(f"r{i}", [5 + i] * (4 + i), SamplingParams(max_tokens=n, **G))
        step(30)

    (_, out), _ = run_pair(program)
    assert [len(out[f"r{i}"].token_ids) for i in range(4)] == [3, 9, 9, 20]


def test_staggered_arrivals_while_a_step_is_pending():
    def program(engine, step):
        for i in range(6):
            engine.add_request(f"r{i}", [7, i + 3, 11], SamplingParams(max_tokens=5 + i, **G))
            step(i % 3)

    run_pair(program)


def test_pause_and_resume_keep_tokens():
    # 4 rows growing into a cache that cannot hold them all: rows pause and resume.
    def program(engine, step):
        for i in range(4):
            engine.add_request(f"r{i}", [9 + i] * 30, SamplingParams(max_tokens=60, **G))

    kw = dict(num_kv_blocks=14, block_size=8)
    (eng, out), (aeng, aout) = run_pair(program, **kw)
    ample = make_engine(False, num_kv_blocks=200, block_size=8)
    ref: dict = {}
    for i in range(4):
        ample.add_request(f"r{i}", [9 + i] * 30, SamplingParams(max_tokens=60, **G))
    drain(ample, ref)
    for rid in ref:
        assert out[rid].token_ids == ref[rid].token_ids
    assert eng.scheduler.stats.pauses > 0 and aeng.scheduler.stats.pauses > 0
    assert aeng.scheduler.stats.resumed > 0


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("self:1", 3)], ids=["plain", "spec"])
def test_eviction_and_recompute(spec):
    """Sampled rows evicted and recomputed emit exactly what they emit without eviction. Under
    speculation this holds only if the recompute resumes decoding from the last token instead
    of sampling a token from the prefill (which would shift every later speculative step)."""
    def program(engine, step):
        for i in range(3):
            engine.add_request(f"r{i}", [4 + i] * 20,
                               SamplingParams(max_tokens=50, temperature=0.8, seed=i,
                                              ignore_eos=True))

    blocks = 9 if spec is None else 10  # one request alone must fit: 20 + 50 (+ K) positions
    (eng, out), (aeng, _) = run_pair(program, num_kv_blocks=blocks, block_size=8, max_batch=3,
                                     speculative=spec)
    assert eng.scheduler.stats.evictions > 0 and aeng.scheduler.stats.evictions > 0
    ample = make_engine(False, num_kv_blocks=100, block_size=8, speculative=spec)
    ref: dict = {}
    for i in range(3):
        ample.add_request(f"r{i}", [4 + i] * 20, SamplingParams(max_tokens=50, temperature=0.8,
                                                                  seed=i, ignore_eos=True))
    drain(ample, ref)
    assert all(out[r].token_ids == ref[r].token_ids for r in ref)


def test_block_boundary_crossed_by_several_rows_at_once():
    def program(engine, step):
        for i in range(4):  # same length: all rows need a new block in the same step
            engine.add_request(f"r{i}", [3 + i] * 8, SamplingParams(max_tokens=30, **G))

    run_pair(program, block_size=8)


@pytest.mark.parametrize("delay", [0, 1, 2, 5])
def test_abort_of_an_in_flight_row(delay):
    def program(engine, step):
        for i in range(3):
            engine.add_request(f"r{i}", [6 + i] * 5, SamplingParams(max_tokens=40, **G))
        step(delay)
        engine.abort("r1")
        step(2)

    (_, sync), (_, asyn) = run_pair(program)
    assert sync["r1"].finish_reason == "abort"


def test_async_runs_no_row_step_whose_tokens_would_be_dropped():
    """A row whose steps in flight are sure to reach max_tokens leaves the batch at once, so
    async mode launches exactly the row-steps sync mode does when every request ends by length
    (before, each such row ran one extra step in async mode and its token was thrown away)."""
    def program(engine, step):
        for i, n in enumerate([1, 2, 7, 12, 12, 30]):
            engine.add_request(f"r{i}", [5 + i] * (3 + 4 * i), SamplingParams(max_tokens=n, **G))
            step(i % 3)

    (eng, out), (aeng, _) = run_pair(program, max_batch=4)
    assert all(o.finish_reason == "length" for o in out.values())
    assert (aeng.stats.steps, aeng.stats.batch_size_sum) == \
        (eng.stats.steps, eng.stats.batch_size_sum)
