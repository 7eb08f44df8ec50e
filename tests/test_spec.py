"""Speculative decoding: greedy output equals plain decoding, sampling stays lossless, sync and
async accept the same drafts, bad configurations are refused, lifecycles keep working."""
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from conftest import make_hf_model
from graphexec import LLM, Engine, SamplingParams, SpeculativeConfig
from graphexec.kernels.rejection import (SALT_DRAFT, draw_from_probs, greedy_accept,
                                         rejection_sample_ref)
from test_lifecycle_state_machine import TALLY, AsyncEqualsSync, ConstrainedAsyncEqualsSync

PROMPTS = [[random.Random(i).randrange(2, 512) for _ in range(3 + 7 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy():
    return [o.token_ids for o in LLM("tiny", max_batch=8).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("draft", ["self:2", "self:1", "tiny"])
def test_greedy_speculative_equals_plain(plain_greedy, draft, k, async_scheduling):
    llm = LLM("tiny", max_batch=8, async_scheduling=async_scheduling,
              speculative=SpeculativeConfig(draft, k))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_greedy
    drafted = sum(o.num_drafted_tokens for o in outs)
    rate = sum(o.num_accepted_tokens for o in outs) / drafted
    if draft == "self:2":  # the whole target: always right
        assert rate == 1.0
    else:  # a weak draft: mostly wrong, and the output is still exact
        assert rate < 0.5


def check_acceptance_parity(params: list[SamplingParams], **engine) -> None:
    """Same seeds: sync and async emit the same tokens and draft/accept the same counts."""
    spec = SpeculativeConfig("self:1", 3)
    runs = [LLM("tiny", async_scheduling=a, speculative=spec, **engine).generate(PROMPTS, params)
            for a in (False, True)]
    for s, a in zip(*runs):
        assert s.token_ids == a.token_ids
        assert (s.num_drafted_tokens, s.num_accepted_tokens) == \
            (a.num_drafted_tokens, a.num_accepted_tokens)
    assert sum(o.num_accepted_tokens for o in runs[0]) > 0


def test_acceptance_is_the_same_in_sync_and_async():
    rng = random.Random(4)
    check_acceptance_parity(
        [SamplingParams(max_tokens=rng.randint(5, 40), temperature=rng.choice([0, 0.7]),
                        top_k=rng.choice([-1, 20]), seed=i, ignore_eos=True)
         for i in range(len(PROMPTS))], max_batch=4)


def _chi2_critical(df: int) -> float:
    # Wilson-Hilferty approximation of the 0.999 quantile of chi-square(df).
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampler_is_lossless(k):
    """Drafts drawn from q, verified against p: the first emitted token is distributed as p."""
    torch.manual_seed(k)
    v, n = 8, 40000
    p = torch.softmax(torch.randn(v) * 1.5, -1)
    q = torch.softmax(torch.randn(v) * 1.5, -1)
    P = p.expand(n, k + 1, v).contiguous()
    Q = q.expand(n, k, v).contiguous()
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 13
    steps = torch.zeros(n, dtype=torch.int64)
    drafts = torch.stack([draw_from_probs(Q[:, j], seeds ^ SALT_DRAFT, steps + j)
                          for j in range(k)], dim=1)
    tokens, count = rejection_sample_ref(P, Q, drafts, seeds, steps)
    first = tokens[:, 0]
    observed = torch.bincount(first, minlength=v).double()
    expected = p.double() * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < _chi2_critical(v - 1), chi2
    assert ((count >= 1) & (count <= k + 1)).all()


def test_speculative_sampling_matches_plain_distribution(tmp_path):
    """End to end on a 16-token vocabulary: the joint distribution of the first two emitted
    tokens is the same with speculation (a different draft model) as without."""
    target, draft = str(tmp_path / "t"), str(tmp_path / "d")
    make_hf_model(target, "llama", seed=1, std=0.15, vocab=16)
    make_hf_model(draft, "llama", seed=2, std=0.15, vocab=16)
    n, cells = 6000, 16 * 16
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(n)]
    counts = []
    for spec in (None, SpeculativeConfig(draft, 2)):
        llm = LLM(target, max_batch=64, num_kv_blocks=256, speculative=spec)
        outs = llm.generate([[3, 5, 7]] * n, params)
        pair = torch.tensor([o.token_ids[1] * 16 + o.token_ids[2] for o in outs])
        counts.append(torch.bincount(pair, minlength=cells).double())
        if spec is not None:
            drafted = sum(o.num_drafted_tokens for o in outs)
            assert 0 < sum(o.num_accepted_tokens for o in outs) < drafted
    a, b = counts
    used = (a + b) > 0
    chi2 = (((a - b) ** 2) / (a + b))[used].sum().item()  # two-sample, equal sizes
    assert chi2 < _chi2_critical(int(used.sum()) - 1), chi2


@pytest.mark.parametrize("kw,match", [
    (dict(draft="self:2", num_tokens=0), "num_tokens"),
    (dict(draft="self:2", num_tokens=9), "num_tokens"),
    (dict(draft="", num_tokens=2), "draft"),
])
def test_bad_speculative_config(kw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kw)


def test_bad_drafts(tmp_path):
    with pytest.raises(ValueError, match="self:3"):
        Engine("tiny", speculative=SpeculativeConfig("self:3", 2))
    with pytest.raises(ValueError, match="vocab"):
        Engine("tiny", speculative=SpeculativeConfig("qwen3-0.6b", 2))
    small = str(tmp_path / "small")
    make_hf_model(small, "llama", vocab=512)  # max_position_embeddings=512
    with pytest.raises(ValueError, match="positions"):
        Engine("tiny", max_model_len=1024, speculative=SpeculativeConfig(small, 2))
    with pytest.raises(ValueError, match="speculative"):
        Engine("tiny", speculative="self:1")


class AsyncEqualsSyncSpeculative(AsyncEqualsSync):
    ENGINE = dict(speculative=SpeculativeConfig("self:1", 3))


def test_lifecycle_state_machine_with_speculation():
    run_state_machine_as_test(AsyncEqualsSyncSpeculative, settings=settings(
        max_examples=15, stateful_step_count=30, deadline=None, database=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))


class ConstrainedAsyncEqualsSyncSpeculative(ConstrainedAsyncEqualsSync):
    ENGINE = dict(speculative=SpeculativeConfig("self:1", 3))


def test_constrained_lifecycle_state_machine_with_speculation():
    """Grammar rows (no drafts; held in the step they join) among penalised and plain rows
    under speculation, with aborts, pauses and evictions: async equals sync, and every
    constrained output is a sentence of its grammar's prefix language."""
    pytest.importorskip("xgrammar")
    TALLY.clear()
    run_state_machine_as_test(ConstrainedAsyncEqualsSyncSpeculative, settings=settings(
        max_examples=8, stateful_step_count=30, deadline=None, database=None,
        derandomize=True, suppress_health_check=[HealthCheck.too_slow]))
    assert TALLY.get("constrained_stop", 0) > 0 and TALLY.get("penalised", 0) > 0, TALLY
    assert TALLY.get("async_pauses", 0) + TALLY.get("async_evictions", 0) > 0, TALLY


@pytest.mark.parametrize("draft", ["self:2", "self:1"])
def test_async_speculation_launches_no_step_past_the_end(draft):
    """The host cannot tell whether a speculative step in flight ends a row (it emits 1..K+1
    tokens). When it may end every row, async mode reads it before launching another: at batch
    1 it then launches exactly as many steps as sync mode, not one more."""
    steps = []
    for async_scheduling in (False, True):
        llm = LLM("tiny", max_batch=4, async_scheduling=async_scheduling,
                  speculative=SpeculativeConfig(draft, 4))
        out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=64, temperature=0,
                                                        ignore_eos=True))
        assert len(out[0].token_ids) == 64
        steps.append(llm.engine.stats.steps)
        if async_scheduling:
            assert llm.engine.stats.settles > 0
    assert steps[0] == steps[1]


def test_greedy_accept_is_rejection_sampling_of_one_hot_distributions():
    """The all-greedy fast path against the general rule on one-hot p and q: same tokens
    (where emitted) and counts, for drafts that match the target's argmax for a while."""
    g = torch.Generator().manual_seed(7)
    b, k, v = 64, 4, 50
    logits = torch.randn(b, k + 1, v, generator=g)
    target = logits.argmax(-1)
    draft = target[:, :k].clone()
    wrong_from = torch.randint(0, k + 1, (b,), generator=g)  # k + 1: all right
    for r in range(b):
        draft[r, wrong_from[r]:] = (draft[r, wrong_from[r]:] + 1) % v
    onehot = lambda idx: torch.nn.functional.one_hot(idx, v).float()
    tokens, count = greedy_accept(logits, draft)
    ref_tokens, ref_count = rejection_sample_ref(onehot(target), onehot(draft), draft,
                                                 torch.arange(b), torch.zeros(b, dtype=torch.long))
    assert torch.equal(count, ref_count)
    assert torch.equal(count, wrong_from.clamp(max=k) + 1)
    for r in range(b):
        assert torch.equal(tokens[r, :count[r]], ref_tokens[r, :count[r]])


def test_all_greedy_fast_path_matches_the_general_path():
    """Greedy rows give the same tokens and draft/accept counts whether the batch is all greedy
    (argmax comparison) or holds a sampled row too (distributions + rejection sampling)."""
    spec = SpeculativeConfig("self:1", 3)
    greedy = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * len(PROMPTS)
    alone = LLM("tiny", max_batch=8, speculative=spec).generate(PROMPTS, greedy)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    mixed = LLM("tiny", max_batch=8, speculative=spec).generate(PROMPTS + [PROMPTS[0]],
                                                                 greedy + [sampled])
    for a, m in zip(alone, mixed):
        assert a.token_ids == m.token_ids
        assert (a.num_drafted_tokens, a.num_accepted_tokens) == \
            (m.num_drafted_tokens, m.num_accepted_tokens)
    assert 0 < sum(o.num_accepted_tokens for o in alone) < sum(o.num_drafted_tokens for o in alone)


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("self:1", 3)])
def test_fused_decode_attention_only_sees_distinct_sequences(monkeypatch, speculative):
    """ops.rope_decode_attention (rope, KV write and attention in one kernel) is valid only when
    every row is its own sequence with its new token at position seq_len - 1: plain decode and
    the draft steps call it; the verify, whose K + 1 rows share a sequence, must not."""
    from dataclasses import replace

    from graphexec import kernels

    fused = kernels.REFERENCE_OPS.rope_decode_attention
    calls = []

    def checked(q, k, v, positions, cos, sin, k_cache, v_cache, slots, tables, seq_lens,
                scale):
        calls.append(q.shape[0])
        assert torch.equal(positions + 1, seq_lens.long())
        live = tables[:, 0] != scratch  # padding rows: every column on the scratch block
        firsts = tables[live, 0].tolist()
        assert len(set(firsts)) == len(firsts), "two rows of one sequence"
        return fused(q, k, v, positions, cos, sin, k_cache, v_cache, slots, tables, seq_lens,
                     scale)

    monkeypatch.setattr(kernels, "REFERENCE_OPS",
                        replace(kernels.REFERENCE_OPS, rope_decode_attention=checked))
    llm = LLM("tiny", max_batch=8, speculative=speculative)
    scratch = llm.engine.runner.state.scratch_block
    outs = llm.generate(PROMPTS, GREEDY)
    assert calls, "decode never used the fused op"
    if speculative is not None:
        assert sum(o.num_accepted_tokens for o in outs) > 0



def test_repeat_rows_is_a_dense_repeat_interleave():
    """The verify's per-row copies (capture/spec_controls.py): repeat_interleave's values, and
    dense even for one row (a stride-0 view once reached a kernel that reads rows densely)."""
    from graphexec.capture.spec_controls import repeat_rows

    for x in (torch.arange(3), torch.arange(1), torch.arange(12).view(3, 4), torch.arange(4)[None]):
        got = repeat_rows(x, 5)
        assert torch.equal(got, x.repeat_interleave(5, dim=0)) and got.is_contiguous()


def test_interleave_takes_states_whose_residual_is_already_added():
    """Draft states from an op set that adds the residual in the projections' epilogues
    (kernels/op_sets.py, FusedOps, 33-64 rows) carry residual None; the verify's interleaved state
    then does too, with the outputs in its row order (row r's K + 1 positions together)."""
    from graphexec.capture.spec_iteration import _interleave
    from graphexec.model.llama import FinalHidden

    outs = [torch.randn(3, 4) for _ in range(2)]
    got = _interleave([FinalHidden(o, None) for o in outs])
    assert got.residual is None
    assert torch.equal(got.out, torch.stack(outs, dim=1).reshape(6, 4))
    res = [torch.randn(3, 4) for _ in range(2)]
    both = _interleave([FinalHidden(o, r) for o, r in zip(outs, res)])
    assert torch.equal(both.out, got.out)
    assert torch.equal(both.residual[1::2], res[1]) and torch.equal(both.residual[::2], res[0])
