"""Penalties, logit bias and min_p through the engine, against oracles outside graphexec:
transformers' generate with its logits processors (repetition penalty, min_p), and a plain-Python
greedy loop over transformers' logits with OpenAI's documented formula (presence, frequency)
and the bias added. Then async equals sync, and pauses, evictions and churn leave the tokens as
they are."""
import random

import pytest
import torch

from graphexec import LLM, Engine, SamplingParams, SpeculativeConfig
from graphexec.capture.penalties import PenaltyState, pack_init
from graphexec.kernels.penalties import IN_PROMPT, LISTED
from graphexec.plan import NewRow, RowPenalties, StepDelta
from test_engine import _prompts, _same, run_engine
from test_kernels_penalties import check_seen_lists

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9, 100, 150]]
N = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from conftest import make_hf_model
    d = str(tmp_path_factory.mktemp("llama-penalties"))
    hf = make_hf_model(d, "llama")
    return d, hf, LLM(d, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=64,
                      block_size=4)


def _hf_generate(hf, prompt, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=N, eos_token_id=None,
                          pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_greedy_matches_transformers(llama):
    _, hf, llm = llama
    for rep in (1.3, 0.8):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0,
                                                    ignore_eos=True, repetition_penalty=rep))
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0,
                                                     ignore_eos=True))
        for p, out, base in zip(PROMPTS, outs, plain):
            assert out.token_ids == _hf_generate(hf, p, do_sample=False,
                                                 repetition_penalty=rep), rep
        assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain))  # it did something


def test_min_p_matches_transformers(llama):
    """Greedy: min_p leaves the argmax, as transformers' greedy search does. Sampled at min_p
    1.0 only the most likely token survives, so a seeded draw must equal transformers' sampling
    with MinPLogitsWarper (and the repetition penalty beside it, which moves the argmax)."""
    _, hf, llm = llama
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True,
                                                  min_p=0.3, repetition_penalty=1.3))
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=N, temperature=1.0, seed=7,
                                                   ignore_eos=True, min_p=1.0,
                                                   repetition_penalty=1.3))
    for p, g, s in zip(PROMPTS, greedy, sampled):
        want = _hf_generate(hf, p, do_sample=False, repetition_penalty=1.3)
        assert g.token_ids == want
        torch.manual_seed(0)
        assert s.token_ids == _hf_generate(hf, p, do_sample=True, temperature=1.0, top_k=0,
                                           min_p=1.0, repetition_penalty=1.3)
        assert s.token_ids == want


def _openai_greedy(hf, prompt, n, presence, frequency, bias):
    """OpenAI's formula, in plain Python over transformers' logits:
    mu[j] - c[j] * frequency - float(c[j] > 0) * presence, after logit_bias is added."""
    ids = list(prompt)
    counts: dict[int, int] = {}
    for _ in range(n):
        with torch.no_grad():
            mu = hf(torch.tensor([ids])).logits[0, -1].tolist()
        for j, b in bias.items():
            mu[j] += b
        for j, c in counts.items():
            mu[j] = mu[j] - c * frequency - float(c > 0) * presence
        tok = max(range(len(mu)), key=lambda j: (mu[j], -j))
        counts[tok] = counts.get(tok, 0) + 1
        ids.append(tok)
    return ids[len(prompt):]


@pytest.mark.parametrize("presence,frequency,bias", [
    (1.5, 0.0, {}), (0.0, 0.7, {}), (0.5, 0.5, {7: 3.0, 99: -100.0, 3: 2.0}),
    (-0.5, -0.2, {}), (0.0, 0.0, {12: 100.0}),
])
def test_presence_frequency_and_bias_match_openai_formula(llama, presence, frequency, bias):
    _, hf, llm = llama
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logit_bias=bias,
                            presence_penalty=presence, frequency_penalty=frequency)
    for p, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.token_ids == _openai_greedy(hf, p, N, presence, frequency, bias)
    if bias.get(12) == 100.0:
        assert set(out.token_ids) == {12}


def _penalised(i, rng):
    kind = i % 5
    return dict(
        presence_penalty=rng.choice([0.0, 1.0, -0.5]) if kind in (0, 1) else 0.0,
        frequency_penalty=rng.choice([0.0, 0.6]) if kind in (0, 2) else 0.0,
        repetition_penalty=rng.choice([1.0, 1.4, 0.9]) if kind in (1, 3) else 1.0,
        min_p=rng.choice([0.0, 0.05, 0.2]) if kind in (2, 3) else 0.0,
        logit_bias={rng.randrange(512): rng.uniform(-5, 5) for _ in range(rng.randint(0, 4))}
        if kind != 4 else None)


def penalised_requests(n, seed, max_tokens=30):
    """Penalised rows (seeded, sampled or greedy) among plain ones."""
    rng = random.Random(seed)
    reqs = []
    for i, prompt in enumerate(_prompts(n, seed=seed, hi=60)):
        extra = _penalised(i, rng) if i % 4 else {}
        reqs.append((f"r{i}", prompt, SamplingParams(
            max_tokens=rng.randint(1, max_tokens), ignore_eos=rng.random() < 0.5,
            temperature=0.0 if i % 3 == 0 else 0.9, seed=i, top_k=20 if i % 7 == 1 else -1,
            logprobs=2 if i % 6 == 0 else None, **extra)))
    return reqs


def test_async_equals_sync_with_penalised_rows():
    reqs = penalised_requests(24, seed=3)
    assert sum(r[2].uses_penalties for r in reqs) >= 12
    sync = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256, async_scheduling=False,
                             max_num_batched_tokens=64), reqs)
    engine = Engine("tiny", max_batch=8, num_kv_blocks=256, async_scheduling=True,
                    max_num_batched_tokens=64)
    _same(sync, run_engine(engine, reqs))
    # every slot went back once its row left
    assert sorted(engine.runner.state.penalties._free) == list(range(1, 9))


def test_penalised_rows_alone_equal_in_a_batch():
    """A row's penalties read its own slot only: the same tokens alone as among others."""
    reqs = penalised_requests(12, seed=4)
    batch = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256), reqs)
    for rid, prompt, params in reqs[:6]:
        alone = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256),
                           [(rid, prompt, params)])
        assert alone[rid].token_ids == batch[rid].token_ids, rid


def test_pause_and_eviction_keep_penalised_tokens():
    """Rows paused or evicted and recomputed refill their slots from the tokens the host holds:
    the same tokens as with a cache that never runs short."""
    rng = random.Random(5)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, seed=i,
                                        temperature=0 if i % 2 else 0.8, **_penalised(i, rng)))
            for i, p in enumerate(_prompts(8, seed=9, hi=30))]
    ample = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256, block_size=4), reqs)
    for mode in (False, True):
        tight = Engine("tiny", max_batch=8, num_kv_blocks=30, block_size=4,
                       async_scheduling=mode)
        _same(ample, run_engine(tight, reqs))
        stats = tight.scheduler.stats
        assert stats.evictions > 0 and stats.pauses > 0


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("self:1", 3)])
def test_seen_lists_hold_each_seen_token_once(speculative):
    """The lists of seen tokens the penalties kernel visits, after every step of a run whose
    rows are paused and evicted (their slots filled again from the host, generated tokens
    included) and, speculating, whose rejected drafts are taken back out: every token of a
    slot's prompt and every one it counts, each once."""
    rng = random.Random(6)
    reqs = [(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, seed=i,
                                        temperature=0 if i % 2 else 0.8,
                                        **_penalised(i % 4, rng)))
            for i, p in enumerate(_prompts(8, seed=9, hi=30))]
    engine = Engine("tiny", max_batch=8, num_kv_blocks=30, block_size=4,
                    speculative=speculative)
    pen = engine.runner.state.penalties
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
        check_seen_lists(pen.counts, pen.flags, pen.seen_ids, pen.num_seen)
    assert engine.scheduler.stats.evictions + engine.scheduler.stats.pauses > 0
    assert pen.num_seen.sum() > 0
    if speculative is not None:  # drafts taken back: listed, outside the prompt, count 0
        assert ((pen.flags == LISTED) & (pen.counts == 0)).any()


def _joining(row: int, prompt: list[int], output: list[int]) -> NewRow:
    return NewRow(row, temperature=1.0, top_k=-1, top_p=1.0, seed=0, min_tokens=0, stop_ids=[],
                  penalties=RowPenalties(0.5, 0.5, 1.2, 0.0, {3: 1.0}, prompt, output))


def _fill(pen: PenaltyState, delta: StepDelta) -> list[int]:
    slots = pen.assign(delta)
    init = pack_init(delta, slots)
    pen.apply_init(init, torch.tensor(init.ints), torch.tensor(init.floats))
    return slots


def _listed(pen: PenaltyState, slot: int) -> list[int]:
    return pen.seen_ids[slot, :pen.num_seen[slot]].tolist()


def test_slot_fill_lists_prompt_and_output_once():
    """A joining row's slot: counts of its generated tokens, the prompt flagged, and one list
    entry for each distinct token of both; a slot handed on is filled afresh."""
    pen = PenaltyState(max_rows=3, vocab_size=40, device=torch.device("cpu"))
    a, b = _fill(pen, StepDelta(2, new_rows=[_joining(0, [5, 5, 7, 9], [7, 11, 11, 2]),
                                             _joining(1, [1], [])]))
    assert sorted(_listed(pen, a)) == [2, 5, 7, 9, 11] and _listed(pen, b) == [1]
    assert (pen.flags[a] & IN_PROMPT).nonzero().flatten().tolist() == [5, 7, 9]
    assert (pen.flags[a] & LISTED).nonzero().flatten().tolist() == [2, 5, 7, 9, 11]
    assert {t: int(pen.counts[a, t]) for t in pen.counts[a].nonzero().flatten().tolist()} == \
        {2: 1, 7: 1, 11: 2}
    # row 0 leaves; the row joining at row 1 takes its slot
    (c,) = _fill(pen, StepDelta(2, row_map=[1], new_rows=[_joining(1, [30, 31], [31])]))
    assert c == a
    assert sorted(_listed(pen, c)) == [30, 31]
    assert (pen.flags[c] != 0).nonzero().flatten().tolist() == [30, 31]
    assert pen.counts[c].nonzero().flatten().tolist() == [31]
    check_seen_lists(pen.counts, pen.flags, pen.seen_ids, pen.num_seen)


def test_bad_logit_bias_refused_under_speculation():
    """Penalties run under speculation (tests/test_spec_controls.py); a bad request is still a
    ValueError naming the field, and the engine keeps serving."""
    from graphexec import SpeculativeConfig
    engine = Engine("tiny", max_batch=2, num_kv_blocks=64,
                    speculative=SpeculativeConfig(draft="self:1", num_tokens=2))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("b", [1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    engine.add_request("a", [1, 2], SamplingParams(presence_penalty=1.0, max_tokens=3))
    assert len(run_engine(engine, [])["a"].token_ids) == 3


def test_plain_batches_take_the_plain_variant():
    """A plan's variant asks for the penalties kernels only while a penalised row is in it."""
    reqs = penalised_requests(8, seed=12)
    engine = Engine("tiny", max_batch=8, num_kv_blocks=256)
    seen = []
    launch = engine.runner.launch

    def spy(delta, prefills, bucket, variant, *rest):
        seen.append((variant.penalties, any(r.params.uses_penalties
                                            for r in engine.scheduler.running)))
        return launch(delta, prefills, bucket, variant, *rest)

    engine.runner.launch = spy
    run_engine(engine, [r for r in reqs if not r[2].uses_penalties])
    assert seen and not any(v for v, _ in seen)
    run_engine(engine, reqs)
    assert all(v == want for v, want in seen) and any(v for v, _ in seen)
