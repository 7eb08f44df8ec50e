"""prompt_logprobs against transformers' own forward over the prompt: each prompt token's
logprob given the tokens before it, and the top n, however the prompt is cut into chunks and
whatever decodes beside it."""
import pytest
import torch

from graphexec import LLM, Engine, SamplingParams
from test_engine import _prompts, run_engine

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9, 100, 150],
           [7] * 3 + list(range(20, 60))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from conftest import make_hf_model
    d = str(tmp_path_factory.mktemp("llama-prompt-logprobs"))
    return d, make_hf_model(d, "llama")


def _hf_prompt_logprobs(hf, prompt):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    return [(lp[i, prompt[i + 1]].item(), lp[i].topk(5)) for i in range(len(prompt) - 1)]


@pytest.mark.parametrize("budget,caching", [(1024, False), (16, False), (16, True)])
def test_prompt_logprobs_match_transformers(llama, budget, caching):
    path, hf = llama
    llm = LLM(path, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=128,
              block_size=4, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    # a plain request first: it decodes beside the prompts, and (with caching) its prompt's
    # blocks are cached, which the prompt_logprobs request must not take
    outs = llm.generate([PROMPTS[3]] + PROMPTS, [SamplingParams(max_tokens=20)] + [
        SamplingParams(max_tokens=3, prompt_logprobs=5, temperature=0)] * len(PROMPTS))
    assert outs[0].prompt_logprobs is None
    for prompt, out in zip(PROMPTS, outs[1:]):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for pos, (lp, (top_v, top_i)) in enumerate(_hf_prompt_logprobs(hf, prompt), start=1):
            assert got[pos].token_id == prompt[pos]
            assert got[pos].logprob == pytest.approx(lp, abs=1e-4)
            assert list(got[pos].top) == top_i.tolist()
            assert list(got[pos].top.values()) == pytest.approx(top_v.tolist(), abs=1e-4)


def test_prompt_logprobs_survive_eviction():
    """A request evicted mid-run keeps the prompt logprobs it had; async equals sync."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0, prompt_logprobs=2)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(_prompts(8, seed=9, hi=30))]
    ample = run_engine(Engine("tiny", max_batch=8, num_kv_blocks=256, block_size=4), reqs)
    for mode in (False, True):
        tight = Engine("tiny", max_batch=8, num_kv_blocks=30, block_size=4,
                       async_scheduling=mode, max_num_batched_tokens=24)
        out = run_engine(tight, reqs)
        assert tight.scheduler.stats.evictions > 0
        for rid in ample:
            a, b = ample[rid].prompt_logprobs, out[rid].prompt_logprobs
            assert [x and x.token_id for x in a] == [x and x.token_id for x in b]
            # the tight engine cuts the prompts into other chunks, whose fp32 GEMMs round
            # otherwise: 1.7e-5 apart at a logprob of -9.4 on one x86 CPU (AMD EPYC)
            assert [x and x.logprob for x in a] == pytest.approx([x and x.logprob for x in b],
                                                                 abs=1e-4)
            assert all(x is not None for x in a[1:])
