"""The mixed step (capture/mixed.py): a step that admits runs its prompt chunks and the rows
already decoding in one forward. The oracle is each request decoded alone, where no step mixes."""
import pytest

from graphexec import Engine, SamplingParams
from graphexec.request import Status
from lifecycle_helpers import check_inert_row, pad_like_graphs
from test_engine import _prompts, run_engine


def _engine(**kw) -> Engine:
    opts = dict(max_batch=8, num_kv_blocks=256, max_model_len=512, seed=3,
                async_scheduling=False, max_num_batched_tokens=64)
    opts.update(kw)
    return Engine("tiny", **opts)


def _count_forwards(engine: Engine) -> list[int]:
    """Wraps the model's forward: the list counts its calls."""
    calls = [0]
    inner = engine.model.forward

    def forward(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)

    engine.model.forward = forward
    return calls


def test_an_admitting_step_runs_one_forward_and_the_joining_row_decodes_next_step():
    engine = _engine()
    forwards = _count_forwards(engine)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], p)
    engine.step()
    engine.step()
    engine.add_request("b", list(range(2, 102)), p)  # 100 tokens: two chunks at this budget
    before = forwards[0]
    steps = [{o.request_id: len(o.new_token_ids) for o in engine.step()} for _ in range(4)]
    # every step: one forward, one token for the decoding row
    assert forwards[0] - before == len(steps)
    assert all(s["a"] == 1 for s in steps)
    first = next(i for i, s in enumerate(steps) if "b" in s)
    assert first == 1  # a 63-token chunk beside "a", then the last 37 tokens
    assert steps[first]["b"] == 1  # the first token only, sampled from the chunk
    assert steps[first + 1]["b"] == 1  # then it decodes with the batch
    assert engine.requests["b"].status is Status.RUNNING


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_decoded_beside_prompt_chunks_equal_each_request_decoded_alone(async_scheduling):
    """Requests arrive while others decode, so most admitting steps mix chunks (some of them
    cut by the budget) with decoding rows; greedy tokens and logprobs equal each request run
    by itself (fp32)."""
    prompts = _prompts(7, seed=4, lo=5, hi=150)
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True,
                             logprobs=3 if i % 2 else None) for i in range(7)]
    alone = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        alone.update(run_engine(_engine(), [(f"r{i}", prompt, p)]))
    engine = _engine(async_scheduling=async_scheduling)
    forwards = _count_forwards(engine)
    final, steps, next_req = {}, 0, 0
    while next_req < len(prompts) or engine.has_unfinished():
        if next_req < len(prompts) and steps % 3 == 0:  # one arrival every third step
            engine.add_request(f"r{next_req}", prompts[next_req], params[next_req])
            next_req += 1
        final.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    assert engine.stats.steps == forwards[0]  # every step, admitting or not, one forward
    assert engine.scheduler.stats.prefill_chunks > 0
    for rid, out in alone.items():
        assert final[rid].token_ids == out.token_ids, rid
        if out.logprobs is not None:
            for a, b in zip(final[rid].logprobs, out.logprobs):
                assert a.token_id == b.token_id
                assert abs(a.logprob - b.logprob) < 1e-4
                assert a.top.keys() == b.top.keys()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_speculative_engine_keeps_the_prefill_and_the_draft_steps_apart():
    from graphexec import SpeculativeConfig

    engine = _engine(speculative=SpeculativeConfig("self:1", 2))
    assert not engine.runner.mixed and not engine.scheduler.mixed
    assert _engine().runner.mixed


def test_padded_mixed_step_as_graphs_run_it_equals_the_exact_one():
    """On CUDA a mixed step runs over the static buffer, padded to a token bucket, with a decode
    part of min(max_batch, bucket) places whose unused ones run as the inert row (what the
    graphs capture). Forced here on the CPU: the same tokens and logprobs as the exact-size
    step, every block back in the pool, and the inert row left inert."""
    prompts = _prompts(6, seed=8, lo=5, hi=120)
    params = [SamplingParams(max_tokens=10 + 2 * i, temperature=0 if i % 2 else 0.7, seed=i,
                             ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
              for i in range(6)]

    def run(padded: bool):
        engine = _engine(max_batch=4, max_num_batched_tokens=96)
        if padded:
            pad_like_graphs(engine)
        final, steps = {}, 0
        while steps < 2 * len(prompts) or engine.has_unfinished():
            if steps % 2 == 0 and steps // 2 < len(prompts):
                i = steps // 2
                engine.add_request(f"r{i}", prompts[i], params[i])
            final.update({o.request_id: o for o in engine.step() if o.finished})
            steps += 1
        check_inert_row(engine)
        assert engine.pool.num_free == engine.pool.num_blocks
        return final

    exact, padded = run(False), run(True)
    assert exact.keys() == padded.keys() == {f"r{i}" for i in range(6)}
    for rid, out in exact.items():
        assert padded[rid].token_ids == out.token_ids, rid
        if out.logprobs is not None:
            for a, b in zip(padded[rid].logprobs, out.logprobs):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
