"""Penalties, logit bias, min_p and token counts: the Triton kernels against the references, and
the references against plain-Python loops of the documented formulas (OpenAI's for presence and
frequency, transformers' for repetition and min_p)."""
import dataclasses
import math

import pytest
import torch

from graphexec.kernels import penalties as pen_ref
from kernel_helpers import DEV, INTERPRET, _gen, big, kernel_test

SIZES = big([(5, 128256), (9, 32000), (3, 5000)], [(5, 300), (3, 2100)])


def _lists(prompt, counts, taken_back, g):
    """flags, seen_ids and num_seen for a state whose listed tokens are its prompt's, those it
    counts and `taken_back` (counted once, then back to 0), each slot's list in a random order.
    Entries past num_seen repeat listed tokens: a kernel reading past the end would penalise
    them twice."""
    s, v = counts.shape
    listed = prompt | (counts > 0) | taken_back
    flags = prompt.to(torch.uint8) * pen_ref.IN_PROMPT + listed.to(torch.uint8) * pen_ref.LISTED
    seen_ids = torch.zeros(s, v, dtype=torch.int32)
    num_seen = torch.zeros(s, dtype=torch.int32)
    for slot in range(s):
        ids = listed[slot].nonzero().flatten()
        n = len(ids)
        ids = ids[torch.randperm(n, generator=g)]
        seen_ids[slot, :n] = ids
        if n:
            seen_ids[slot, n:] = ids[torch.randint(0, n, (v - n,), generator=g)]
        num_seen[slot] = n
    return flags, seen_ids, num_seen


def _state(b, v, seed, slots=None):
    """Random per-slot state for b rows over S = b + 2 slots; row i holds slot i + 1 except
    every third row, which holds none (slot 0). Slot 2 (row 1) has seen nothing: an empty
    list."""
    g = _gen(seed)
    s = b + 2
    if slots is None:
        slots = [0 if i % 3 == 2 else i + 1 for i in range(b)]
    counts = torch.randint(0, 4, (s, v), generator=g, dtype=torch.int32)
    counts *= torch.rand(s, v, generator=g) < 0.05  # most tokens never generated
    prompt = torch.rand(s, v, generator=g) < 0.05
    taken_back = (torch.rand(s, v, generator=g) < 0.02) & (counts == 0)
    counts[2], prompt[2], taken_back[2] = 0, False, False
    flags, seen_ids, num_seen = _lists(prompt, counts, taken_back, g)
    presence = torch.rand(s, generator=g) * 4 - 2
    frequency = torch.rand(s, generator=g) * 4 - 2
    repetition = torch.rand(s, generator=g) * 1.5 + 0.5
    n = 7
    ids = torch.stack([torch.randperm(v, generator=g)[:n] for _ in range(s)])
    ids[:, -2:] = -1  # pads
    vals = torch.rand(s, n, generator=g) * 200 - 100
    for x in (presence, frequency):  # slot 0: nobody's, neutral
        x[0] = 0
    repetition[0] = 1
    return dict(slots=torch.tensor(slots), counts=counts, prompt=prompt, flags=flags,
                seen_ids=seen_ids, num_seen=num_seen, presence=presence, frequency=frequency,
                repetition=repetition, ids=ids, vals=vals)


def _to(st):
    return {k: v.to(DEV) for k, v in st.items()}


def _python_penalties(logits, st):
    """vLLM's order, one entry at a time: bias, repetition (transformers), frequency and
    presence (OpenAI: mu - c * a_freq - (c > 0) * a_pres)."""
    out = logits.clone()
    for i, slot in enumerate(st["slots"].tolist()):
        if slot == 0:
            continue
        for t, bias in zip(st["ids"][slot].tolist(), st["vals"][slot].tolist()):
            if t >= 0:
                out[i, t] += bias
        rep = st["repetition"][slot].item()
        for t in range(out.shape[1]):
            c = int(st["counts"][slot, t])
            x = out[i, t].item()
            if c > 0 or st["prompt"][slot, t]:
                x = x / rep if x > 0 else x * rep
            x = x - c * st["frequency"][slot].item() - (c > 0) * st["presence"][slot].item()
            out[i, t] = x
    return out


def _apply(bias_fn, penalties_fn, logits, st):
    bias_fn(logits, st["slots"], st["ids"], st["vals"])
    return penalties_fn(logits, st["slots"], *_seen(st), st["presence"], st["frequency"],
                        st["repetition"])


def _seen(st):
    return st["counts"], st["flags"], st["seen_ids"], st["num_seen"]


def _bits(x):
    """The logits' bit patterns: -0.0 and 0.0 differ."""
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


REF = (pen_ref.apply_logit_bias_ref, pen_ref.apply_penalties_ref)


def test_reference_matches_the_formulas():
    b, v = 4, 60
    st = _state(b, v, 3)
    st["counts"][1, 5] = 3  # a token generated three times, also in the prompt
    st["prompt"][1, 5] = True
    st["flags"][1, 5] = pen_ref.IN_PROMPT | pen_ref.LISTED
    logits = torch.randn(b, v, generator=_gen(4)) * 5
    want = _python_penalties(logits, st)
    got = _apply(*REF, logits.clone(), st)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(got[2], logits[2])  # slot 0: untouched
    assert not torch.equal(got[0], logits[0])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("list_block", [16, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", SIZES)
def test_penalties_match_reference(K, dtype, b, v, list_block):
    """The kernel visits each row's list only; the reference's dense pass is its oracle, bit
    for bit: listed tokens back at count 0 (outside the prompt: untouched), prompt-only tokens,
    an empty list, rows without a slot. list_block 16: many passes over a list."""
    from graphexec.kernels import penalties_triton
    from graphexec.kernels.tuning import DEFAULT
    tuning = DEFAULT.sampling
    if list_block is not None:
        tuning = dataclasses.replace(tuning, penalty_list_block=list_block)
    st = _to(_state(b, v, 10 + b))
    g = _gen(11)
    logits = (torch.randn(b, v, generator=g) * 4).to(DEV, dtype)
    logits[0, :3] = float("-inf")  # a masked stop id stays masked
    logits[torch.rand(b, v, generator=g).to(DEV) < 0.05] = -0.0  # unseen ones keep their sign
    ref = _apply(*REF, logits.clone(), st)
    out = logits.clone()
    apply = lambda *args: penalties_triton.apply_penalties(*args, tuning=tuning)  # noqa: E731
    _apply(penalties_triton.apply_logit_bias, apply, out, st)
    assert torch.isinf(out[0, :3]).all()
    alone = apply(logits.clone(), st["slots"], *_seen(st), st["presence"], st["frequency"],
                  st["repetition"])
    untouched = [1] + [i for i, s in enumerate(st["slots"].tolist()) if s == 0]  # row 1: slot 2
    assert torch.equal(_bits(alone[untouched]), _bits(logits[untouched]))
    assert not torch.equal(alone[0], logits[0])
    if dtype == torch.float32 or not INTERPRET:
        assert torch.equal(_bits(out), _bits(ref))
    else:  # the interpreter truncates fp32 -> bf16 where the GPU and torch round
        torch.testing.assert_close(out.float(), ref.float(), atol=0.07, rtol=1e-2)


def _python_min_p(logits, temperature, min_p):
    """transformers' MinPLogitsWarper after temperature: keep p >= min_p * max p."""
    out = logits.clone()
    for i in range(out.shape[0]):
        if temperature[i] <= 0 or min_p[i] <= 0:
            continue
        p = torch.softmax(logits[i].double() / float(temperature[i]), -1)
        out[i][p < min_p[i] * p.max()] = float("-inf")
    return out


def test_min_p_reference_matches_softmax_rule():
    b, v = 6, 80
    logits = torch.randn(b, v, generator=_gen(5)) * 3
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 1.0])
    min_p = [0.1, 0.3, 0.5, 0.05, 0.0, 1.0]
    slots = torch.tensor([1, 2, 3, 4, 5, 6])
    log_min_p = torch.tensor([-math.inf] + [math.log(p) if p > 0 else -math.inf
                                            for p in min_p])
    got = pen_ref.apply_min_p_ref(logits.clone(), slots, temperature, log_min_p)
    want = _python_min_p(logits, temperature, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got[0]).any() and not torch.isinf(got[2]).any()
    assert (~torch.isinf(got[5])).sum() == 1  # min_p 1: the argmax alone


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", SIZES)
def test_min_p_matches_reference(K, dtype, b, v):
    from graphexec.kernels import penalties_triton
    g = _gen(20 + b)
    logits = (torch.randn(b, v, generator=g) * 3).to(DEV, dtype)
    temperature = torch.rand(b, generator=g) * 1.5
    temperature[0] = 0  # greedy: untouched
    slots = torch.arange(b) % 3  # slot 0 rows untouched
    log_min_p = torch.log(torch.rand(b + 2, generator=g) * 0.3)
    args = (slots.to(DEV), temperature.to(DEV), log_min_p.to(DEV))
    ref = pen_ref.apply_min_p_ref(logits.clone(), *args)
    out = penalties_triton.apply_min_p(logits.clone(), *args)
    assert torch.equal(out, ref)
    assert torch.isinf(out.float()).any()


def _python_count(st, slots, tokens, live):
    """count_tokens, one row at a time: count the token; list it if it is not listed yet."""
    for slot, t, on in zip(slots.tolist(), tokens.tolist(), live.tolist()):
        if slot == 0 or not on:
            continue
        st["counts"][slot, t] += 1
        if not st["flags"][slot, t] & pen_ref.LISTED:
            st["seen_ids"][slot, st["num_seen"][slot]] = t
            st["num_seen"][slot] += 1
            st["flags"][slot, t] |= pen_ref.LISTED


def check_seen_lists(counts, flags, seen_ids, num_seen):
    """Each slot lists its prompt's tokens and those it counts, each once, and the tokens
    flagged LISTED are the listed ones (a token taken back to count 0 may stay listed)."""
    for slot in range(counts.shape[0]):
        ids = seen_ids[slot, :num_seen[slot]].tolist()
        assert len(set(ids)) == len(ids), slot
        assert set(ids) == set((flags[slot] & pen_ref.LISTED).nonzero().flatten().tolist()), slot
        must = ((flags[slot] & pen_ref.IN_PROMPT) != 0) | (counts[slot] > 0)
        assert set(must.nonzero().flatten().tolist()) <= set(ids), slot


def _clone(st):
    return {k: x.clone() for k, x in st.items()}


def test_count_tokens_reference_matches_the_loop():
    b, v = 6, 40
    st = _state(b, v, 31, slots=[3, 0, 1, 6, 0, 2])
    st["flags"][6] |= pen_ref.LISTED  # slot 6 has listed every token: its list is full
    st["seen_ids"][6] = torch.randperm(v, generator=_gen(32))
    st["num_seen"][6] = v
    first = _clone(st)
    g = _gen(33)
    for _ in range(30):  # few distinct tokens: most are counted again
        tokens = torch.randint(0, 8, (b,), generator=g)
        live = torch.rand(b, generator=g) < 0.8
        want = _clone(st)
        _python_count(want, st["slots"], tokens, live)
        pen_ref.count_tokens_ref(*_seen(st), st["slots"], tokens, live)
        for k in ("counts", "flags", "num_seen", "seen_ids"):
            assert torch.equal(st[k], want[k]), k
    check_seen_lists(*_seen(st))
    assert (st["num_seen"] > first["num_seen"]).any()
    for k in ("counts", "flags", "num_seen", "seen_ids"):  # slot 0: nobody's, left as it is
        assert torch.equal(st[k][0], first[k][0]), k


@kernel_test
@pytest.mark.gpu
def test_count_tokens_matches_reference(K):
    """Many steps over few distinct tokens, some counts taken back to 0 between them (a
    speculative step's rejected drafts): the same counts, flags and lists, no token listed
    twice, and the penalties over the lists still equal the dense pass."""
    from graphexec.kernels import penalties_triton
    b, v = 6, 50
    st = _to(_state(b, v, 30, slots=[3, 0, 1, 6, 0, 2]))
    ref, out = _clone(st), _clone(st)
    g = _gen(34)
    for step in range(40):
        tokens = torch.randint(0, 10, (b,), generator=g).to(DEV)
        live = (torch.rand(b, generator=g) < 0.8).to(DEV)
        pen_ref.count_tokens_ref(*_seen(ref), ref["slots"], tokens, live)
        penalties_triton.count_tokens(*_seen(out), out["slots"], tokens, live)
        for k in ("counts", "flags", "num_seen"):
            assert torch.equal(out[k], ref[k]), (step, k)
        for slot in range(b + 2):
            n = int(ref["num_seen"][slot])
            listed = [set(x["seen_ids"][slot, :n].tolist()) for x in (ref, out)]
            assert listed[0] == listed[1], (step, slot)
        if step % 3 == 2:  # take this step's tokens back out, as recount takes drafts
            on = (live & (ref["slots"] > 0)).to(torch.int32)
            for x in (ref, out):
                x["counts"].index_put_((x["slots"], tokens), -on, accumulate=True)
    check_seen_lists(*(x.cpu() for x in _seen(out)))
    back = (out["counts"] == 0) & (out["flags"] == pen_ref.LISTED)
    assert back[1:].any()  # listed, outside the prompt, count back at 0
    logits = (torch.randn(b, v, generator=_gen(35)) * 4).to(DEV)
    want = pen_ref.apply_penalties_ref(logits.clone(), out["slots"], *_seen(out),
                                       out["presence"], out["frequency"], out["repetition"])
    got = penalties_triton.apply_penalties(logits.clone(), out["slots"], *_seen(out),
                                           out["presence"], out["frequency"], out["repetition"])
    assert torch.equal(_bits(got), _bits(want))


def _one_row_controls_state(v: int, token: int):
    """A DecodeState of four rows whose row 0 holds slot 2 (min_p 0.1, a logit bias on
    `token`); rows 1-3 hold no slot."""
    from graphexec.capture.state import DecodeState

    st = DecodeState(4, 2, v, 0, DEV, penalties=True)
    st.penalty_slots[0] = 2
    st.penalties.log_min_p[2] = math.log(0.1)
    st.penalties.bias_ids[2, 0] = token
    st.penalties.bias_vals[2, 0] = 5.0
    return st


@kernel_test
@pytest.mark.gpu
def test_speculative_controls_of_a_lone_row_reach_every_position():
    """A bucket of one row: the verify's K + 1 positions all take the row's bias and min_p,
    as the references give them. (The per-position slots were once a stride-0 view there,
    and the kernels took rows 1..K's slots for positions 1..K.)"""
    from types import SimpleNamespace

    from graphexec.capture.spec_controls import apply_controls
    from graphexec.kernels import penalties_triton as tri

    v, k, token = big(32000, 300), 3, 7
    g = _gen(41)
    logits = (torch.randn(1, k + 1, v, generator=g) * 3).to(DEV, torch.bfloat16)
    # biased to 13.0 (exact in bf16: no rounding tie), above min_p's floor everywhere
    logits[0, :, token] = 8.0
    drafts = [torch.randint(0, v, (1,), generator=g).to(DEV) for _ in range(k)]
    temperature = torch.full((k + 1,), 0.9, device=DEV)
    live = torch.ones(1, dtype=torch.bool, device=DEV)
    outs = []
    for ops in (SimpleNamespace(apply_logit_bias=pen_ref.apply_logit_bias_ref,
                                apply_penalties=pen_ref.apply_penalties_ref,
                                apply_min_p=pen_ref.apply_min_p_ref,
                                count_tokens=pen_ref.count_tokens_ref),
                SimpleNamespace(apply_logit_bias=tri.apply_logit_bias,
                                apply_penalties=tri.apply_penalties,
                                apply_min_p=tri.apply_min_p, count_tokens=tri.count_tokens)):
        out = logits.clone()
        apply_controls(SimpleNamespace(ops=ops), _one_row_controls_state(v, token), out,
                       drafts, temperature, live, grammar=False)
        outs.append(out)
    ref, got = outs
    assert torch.equal(got, ref)
    removed = torch.isinf(got[0].float()).sum(-1)
    assert (removed > 0).all() and (removed < v).all(), removed  # min_p at every position
    assert (got[0, :, token] == 13.0).all()
