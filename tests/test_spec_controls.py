"""Grammar rows, penalties, logit bias and min_p under speculative decoding.

Oracles outside the code under test: greedy penalised and greedy constrained rows equal the
same requests on the engine without speculation (itself checked against transformers' logits
processors in test_penalties.py), token for token; constrained outputs parse with `json`,
fullmatch with `re`, and a fresh xgrammar matcher accepts every token; async equals sync; the
rejection sampler's first token for a row without drafts is distributed as p (chi-square)."""
import json
import random
import re

import pytest
import torch

from graphexec import Engine, SamplingParams, SpeculativeConfig
from graphexec.kernels.rejection import rejection_sample_ref
from graphexec.structured import StructuredOutputsParams as S
from test_engine import _prompts, _same, run_engine
from test_penalties import _penalised, penalised_requests
from test_spec import _chi2_critical

ENGINE = dict(max_batch=8, num_kv_blocks=256)


def _spec(draft: str = "self:1", k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(draft, k)


def _greedy_penalised(n: int, seed: int) -> list:
    """Greedy rows with every control (each kind of _penalised), some plain, some with
    min_tokens and stop ids, so penalties meet the stop mask at the verified positions."""
    rng = random.Random(seed)
    reqs = []
    for i, prompt in enumerate(_prompts(n, seed=seed, hi=30)):
        extra = _penalised(i, rng) if i % 5 else {}
        reqs.append((f"g{i}", prompt, SamplingParams(
            max_tokens=rng.randint(8, 40), temperature=0.0, ignore_eos=rng.random() < 0.5,
            min_tokens=rng.choice([0, 6]), stop_token_ids=rng.sample(range(2, 512), 3),
            logprobs=2 if i % 4 == 0 else None, **extra)))
    return reqs


@pytest.mark.parametrize("draft,k", [("self:2", 4), ("self:1", 3), ("tiny", 2)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_penalised_rows_equal_plain_decoding(draft, k, async_scheduling):
    """The verify applies each position's controls with the drafts before it counted: every
    greedy token equals plain decoding's, with a perfect draft (self:2 is the whole target),
    a weak one, and a draft model of its own."""
    reqs = _greedy_penalised(12, seed=21)
    assert sum(r[2].uses_penalties for r in reqs) >= 6
    plain = run_engine(Engine("tiny", **ENGINE), reqs)
    engine = Engine("tiny", async_scheduling=async_scheduling, speculative=_spec(draft, k),
                    **ENGINE)
    spec = run_engine(engine, reqs)
    _same(plain, spec)
    if draft.startswith("self:"):  # the draft model of its own is random: it rarely hits
        assert sum(o.num_accepted_tokens for o in spec.values()) > 0


def test_frequency_penalty_counts_accepted_drafts():
    """A strong frequency penalty changes the argmax at most positions, so a wrong count of
    the same step's accepted drafts would show within a few tokens: one long row, whole-target
    draft (most drafts accepted), against plain decoding."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                            frequency_penalty=0.4, presence_penalty=0.3)
    reqs = [("f", _prompts(1, seed=3)[0], params)]
    plain = run_engine(Engine("tiny", **ENGINE), reqs)
    spec = run_engine(Engine("tiny", speculative=_spec("self:2", 4), **ENGINE), reqs)
    assert spec["f"].token_ids == plain["f"].token_ids
    assert spec["f"].num_accepted_tokens > 0
    unpenalised = run_engine(Engine("tiny", **ENGINE), [("f", reqs[0][1], SamplingParams(
        max_tokens=60, temperature=0.0, ignore_eos=True))])
    assert unpenalised["f"].token_ids != plain["f"].token_ids  # the penalty did something


def test_sampled_penalised_rows_async_equals_sync():
    reqs = penalised_requests(20, seed=8)
    runs = [run_engine(Engine("tiny", async_scheduling=a, speculative=_spec(), **ENGINE,
                              max_num_batched_tokens=64), reqs) for a in (False, True)]
    _same(*runs)
    for rid in runs[0]:
        s, a = runs[0][rid], runs[1][rid]
        assert (s.num_drafted_tokens, s.num_accepted_tokens) == \
            (a.num_drafted_tokens, a.num_accepted_tokens), rid


def test_rows_without_drafts_sample_from_p():
    """A grammar row's drafts are rejected whatever they are and its token is drawn from the
    target's distribution itself, not from a residual of it."""
    torch.manual_seed(3)
    k, v, n = 3, 8, 40000
    p = torch.softmax(torch.randn(v) * 1.5, -1)
    q = torch.softmax(torch.randn(v) * 1.5, -1)
    P = p.expand(n, k + 1, v).contiguous()
    Q = q.expand(n, k, v).contiguous()
    drafts = torch.full((n, k), int(p.argmax()))  # the likeliest token: mostly accepted else
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    tokens, count = rejection_sample_ref(P, Q, drafts, seeds, torch.zeros(n, dtype=torch.long),
                                         torch.ones(n, dtype=torch.bool))
    assert (count == 1).all()
    observed = torch.bincount(tokens[:, 0], minlength=v).double()
    expected = p.double() * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < _chi2_critical(v - 1), chi2


# -- grammar rows over the tiny preset's made-up vocabulary ------------------------------------

def _tiny_grammars(engine: Engine) -> list[str]:
    from graphexec.structured import Grammars
    from test_lifecycle_state_machine import _tiny_vocab

    eos = list(engine.model_config.eos_token_ids)
    vocab = _tiny_vocab(engine.model_config.vocab_size, eos)
    engine._grammars = Grammars.for_vocab(vocab, eos)
    return vocab


REGEX = "[a-c]{1,6}-[0-9]{2}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


def _mixed_batch(seed: int, greedy_only: bool = False) -> list:
    """Constrained rows (regex, choice, JSON schema; some penalised too) among penalised and
    plain ones, greedy and seeded."""
    rng = random.Random(seed)
    specs = [S(regex=REGEX), S(choice=["abc", "de", "fghij"]), S(json=SCHEMA), None, None]
    reqs = []
    for i, prompt in enumerate(_prompts(15, seed=seed, hi=40)):
        spec = specs[i % len(specs)]
        extra = _penalised(i, rng) if i % 3 == 1 else {}
        reqs.append((f"m{i}", prompt, SamplingParams(
            max_tokens=48, temperature=0.0 if greedy_only or i % 2 else 0.9, seed=i,
            structured_outputs=spec, ignore_eos=spec is None and rng.random() < 0.5,
            **extra)))
    return reqs


def _check_constrained(engine: Engine, vocab: list[str], reqs: list, outs: dict) -> int:
    """Every constrained output, cut or whole, is accepted token by token by a fresh matcher;
    whole ones (ended by EOS) parse / fullmatch. Returns how many were whole."""
    eos = set(engine.model_config.eos_token_ids)
    whole = 0
    for rid, _, params in reqs:
        spec = params.structured_outputs
        if spec is None:
            continue
        out = outs[rid]
        matcher = engine._grammars.matcher(spec)
        for t in out.token_ids:
            matcher.accept(t)
        assert matcher.rejected == 0, (rid, out.token_ids)
        assert out.num_drafted_tokens == 0, rid  # grammar rows take no drafts
        if out.finish_reason != "stop":
            continue
        text = "".join(vocab[t] for t in out.token_ids if t not in eos)
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, text), text
        elif spec.choice is not None:
            assert text in spec.choice, text
        else:
            value = json.loads(text)
            assert set(value) == {"a", "b"} and isinstance(value["a"], int), text
            assert value["b"] in ("x", "yz"), text
        whole += 1
    return whole


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_constrained_rows_equal_plain_decoding(async_scheduling):
    """A grammar row's one token a step is masked by the host's mask at the step's first
    position, as without speculation: greedy output equals plain decoding's, and the plain
    rows beside it still draft and accept."""
    reqs = _mixed_batch(seed=31, greedy_only=True)
    plain_engine = Engine("tiny", **ENGINE)
    vocab = _tiny_grammars(plain_engine)
    plain = run_engine(plain_engine, reqs)
    engine = Engine("tiny", async_scheduling=async_scheduling, speculative=_spec("self:2", 3),
                    **ENGINE)
    _tiny_grammars(engine)
    spec = run_engine(engine, reqs)
    _same(plain, spec)
    assert _check_constrained(engine, vocab, reqs, spec) >= 3
    assert sum(spec[rid].num_accepted_tokens for rid, _, p in reqs
               if p.structured_outputs is None) > 0
    assert engine.stats.grammar_waits > 0 or not async_scheduling


def test_mixed_batch_async_equals_sync_and_outputs_are_sentences():
    """Constrained, penalised and plain rows, seeded and greedy, with a small budget so
    prompts are prefilled in chunks and grammar rows join in speculative steps."""
    reqs = _mixed_batch(seed=32)
    runs, engines = [], []
    for a in (False, True):
        engine = Engine("tiny", async_scheduling=a, speculative=_spec(), **ENGINE,
                        max_num_batched_tokens=48)
        vocab = _tiny_grammars(engine)
        runs.append(run_engine(engine, reqs))
        engines.append(engine)
    _same(*runs)
    assert _check_constrained(engines[1], vocab, reqs, runs[1]) >= 3
    assert engines[1].scheduler.stats.prefill_chunks > 0


# -- a real tokenizer: JSON schemas and regexes on SmolLM2 -------------------------------------

def test_smollm2_constrained_rows_validate_under_speculation():
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    from test_structured_outputs import MODEL, PROMPT

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}
    regex = r"[A-Z][a-z]{1,6} [0-9]{2,4}"
    reqs = [("j0", PROMPT, SamplingParams(max_tokens=40, temperature=0.0,
                                          structured_outputs=S(json=schema))),
            ("j1", PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                          structured_outputs=S(json=schema),
                                          presence_penalty=0.5)),
            ("x0", "A name and a year:", SamplingParams(max_tokens=16, temperature=0.8,
                                                        seed=4, structured_outputs=S(regex=regex))),
            ("p0", PROMPT, SamplingParams(max_tokens=16, temperature=0.0))]
    engine = Engine(MODEL, max_model_len=256, max_batch=4, speculative=_spec("self:15", 3))
    outs = run_engine(engine, reqs)
    for rid in ("j0", "j1"):
        assert outs[rid].finish_reason == "stop", outs[rid].text
        jsonschema.validate(json.loads(outs[rid].text), schema)
    assert outs["x0"].finish_reason == "stop" and re.fullmatch(regex, outs["x0"].text)
    assert outs["p0"].num_drafted_tokens > 0


def test_draws_never_pick_a_token_of_probability_zero(monkeypatch):
    """The uniforms reach 1.0 in fp32 for one entry in 2**24: -log(u) is then 0 and the
    Gumbel noise +inf, which on log(0) = -inf made a NaN that argmax picked (a masked token
    drawn in about one verify in 300 at a vocabulary of 49k)."""
    from graphexec.kernels import rejection

    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0]])
    u = torch.tensor([[1.0, 0.5, 0.5, 0.5]])
    monkeypatch.setattr(rejection, "uniform_noise", lambda seeds, steps, v: u)
    assert rejection.draw_from_probs(probs, torch.zeros(1), torch.zeros(1)).item() in (1, 2)
