"""Penalties, logit bias, min_p and token counts: the Triton kernels against the references, and
the references against plain-Python loops of the documented formulas (OpenAI's for presence and
frequency, transformers' for repetition and min_p)."""
import math

import pytest
import torch

from graphexec.kernels import penalties as pen_ref
from kernel_helpers import DEV, _gen, big, kernel_test

SIZES = big([(5, 128256), (9, 32000), (3, 5000)], [(5, 300), (3, 2100)])


def _state(b, v, seed, slots=None):
    """Random per-slot state for b rows over S = b + 2 slots; row i holds slot i + 1 except
    every third row, which holds none (slot 0)."""
    g = _gen(seed)
    s = b + 2
    if slots is None:
        slots = [0 if i % 3 == 2 else i + 1 for i in range(b)]
    counts = torch.randint(0, 4, (s, v), generator=g, dtype=torch.int32)
    counts *= torch.rand(s, v, generator=g) < 0.05  # most tokens never generated
    prompt = torch.rand(s, v, generator=g) < 0.05
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
    return dict(slots=torch.tensor(slots), counts=counts, prompt=prompt, presence=presence,
                frequency=frequency, repetition=repetition, ids=ids, vals=vals)


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
    return penalties_fn(logits, st["slots"], st["counts"], st["prompt"], st["presence"],
                        st["frequency"], st["repetition"])


REF = (pen_ref.apply_logit_bias_ref, pen_ref.apply_penalties_ref)


def test_reference_matches_the_formulas():
    b, v = 4, 60
    st = _state(b, v, 3)
    st["counts"][1, 5] = 3  # a token generated three times, also in the prompt
    st["prompt"][1, 5] = True
    logits = torch.randn(b, v, generator=_gen(4)) * 5
    want = _python_penalties(logits, st)
    got = _apply(*REF, logits.clone(), st)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(got[2], logits[2])  # slot 0: untouched
    assert not torch.equal(got[0], logits[0])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", SIZES)
def test_penalties_match_reference(K, dtype, b, v):
    from graphexec.kernels import penalties_triton
    st = _to(_state(b, v, 10 + b))
    logits = (torch.randn(b, v, generator=_gen(11)) * 4).to(DEV, dtype)
    logits[0, :3] = float("-inf")  # a masked stop id stays masked
    ref = _apply(*REF, logits.clone(), st)
    out = logits.clone()
    _apply(penalties_triton.apply_logit_bias, penalties_triton.apply_penalties, out, st)
    assert torch.isinf(out[0, :3]).all()
    rows_off = [i for i, s in enumerate(st["slots"].tolist()) if s == 0]
    assert torch.equal(out[rows_off], logits[rows_off])
    # a fused multiply-add may round a penalised logit by an ulp
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5 if dtype == torch.float32
                               else 0.07, rtol=1e-5 if dtype == torch.float32 else 1e-2)


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


@kernel_test
@pytest.mark.gpu
def test_count_tokens_matches_reference(K):
    from graphexec.kernels import penalties_triton
    b, v = 6, 50
    counts = torch.randint(0, 3, (b + 1, v), dtype=torch.int32, generator=_gen(30)).to(DEV)
    slots = torch.tensor([3, 0, 1, 6, 0, 2], device=DEV)
    tokens = torch.tensor([4, 4, 9, 49, 0, 4], device=DEV)
    live = torch.tensor([True, True, True, False, True, True], device=DEV)
    ref = counts.clone()
    pen_ref.count_tokens_ref(ref, slots, tokens, live)
    out = counts.clone()
    penalties_triton.count_tokens(out, slots, tokens, live)
    assert torch.equal(out, ref)
    diff = (ref - counts).nonzero().tolist()
    assert diff == [[1, 9], [2, 4], [3, 4]]  # slot 0 and the row that is not live: nothing
