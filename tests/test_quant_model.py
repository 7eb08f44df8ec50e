"""Quantized weights through the whole model: graphexec quantizing a small HF Llama at load
equals, greedy token for token (fp32, CPU), transformers run on the same weights quantized and
dequantized by the formulas written out here; and the options' checks."""
import copy

import pytest
import torch

from conftest import make_hf_model
from graphexec import LLM, SamplingParams
from graphexec.config import EngineConfig

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9]]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_rtn(w):
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def _int4_rtn(w, symmetric, group=128):
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    if symmetric:
        scale = g.abs().amax(dim=2, keepdim=True) / 7.5
        return (torch.round(g / scale).clamp(-8, 7) * scale).reshape(n, k)
    lo = g.amin(dim=2, keepdim=True).clamp(max=0)
    hi = g.amax(dim=2, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 15
    zero = (-8 - torch.round(lo / scale)).clamp(-8, 7)
    q = (torch.round(g / scale) + zero).clamp(-8, 7)
    return ((q - zero) * scale).reshape(n, k)


RTN = {"fp8": _fp8_rtn, "int4": lambda w: _int4_rtn(w, True),
       "int4_asym": lambda w: _int4_rtn(w, False)}


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama-quant"))
    return d, make_hf_model(d, "llama")


@pytest.mark.parametrize("method", list(RTN))
def test_greedy_generation_matches_transformers_dequantized(hf_llama, method):
    path, hf = hf_llama
    hf = copy.deepcopy(hf)
    dense = {}
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                dense[name] = module.weight.clone()
                module.weight.copy_(RTN[method](module.weight.float()))
    # the quantization changes the weights enough to matter
    changed = max((dict(hf.named_modules())[n].weight - w).abs().max().item()
                  for n, w in dense.items())
    assert changed > 1e-3
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=64,
             block_size=4, quantization=method) as llm:
        assert llm.engine.model.ops.name.endswith("quantized")
        outs = llm.generate(PROMPTS, params)
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist(), method


@pytest.mark.parametrize("value", ["int8", "FP8", 4, True])
def test_bad_quantization_is_a_value_error(value):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="tiny", device="cpu", quantization=value)


def test_none_means_dense():
    assert EngineConfig(model="tiny", device="cpu", quantization="none").quantization is None


def test_int4_group_must_divide_the_input_dim():
    # tiny's hidden size is 128, its MLP width 256: a group of 128 fits; the check is on K
    from graphexec.model.quantize import quantize_tensor

    with pytest.raises(ValueError, match="straddle"):
        quantize_tensor(torch.randn(8, 192), "int4")


def test_a_rank_quantizes_its_share():
    """Under tensor parallelism a rank quantizes its own slice: qkv keeps whole channels with
    their scales, and an int4 group that a rank boundary would cut is a ValueError naming it
    (tiny's o has 128 input columns: 64 a rank at size 2, half a group of 128)."""
    from graphexec.kernels.quant import QuantizedWeight, dequantize
    from graphexec.model import load_model, resolve_model
    from graphexec.model.shard import Shard

    src, cpu = resolve_model("tiny"), torch.device("cpu")
    _, whole = load_model(src, cpu, torch.float32, quantization="fp8")
    _, rank1 = load_model(src, cpu, torch.float32, shard=Shard(rank=1, size=2),
                          quantization="fp8")
    qkv = rank1.layers[0].qkv
    assert isinstance(qkv, QuantizedWeight) and qkv.shape[0] * 2 == whole.layers[0].qkv.shape[0]
    # the rank's q rows are the whole model's second half of q, scales and all
    q_rows = qkv.shape[0] // 2  # tiny: q is half of qkv (4 heads; 2 + 2 KV heads)
    torch.testing.assert_close(dequantize(qkv)[:q_rows],
                               dequantize(whole.layers[0].qkv)[q_rows:2 * q_rows],
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="straddle"):
        load_model(src, cpu, torch.float32, shard=Shard(rank=0, size=2), quantization="int4")


def test_server_flags_reach_the_engine_options():
    from graphexec.serve.__main__ import engine_options, parse_args

    args = parse_args(["--model", "tiny", "--quantization", "int4", "--kv-cache-dtype", "fp8"])
    opts = engine_options(args, pytest.fail)
    assert opts["quantization"] == "int4" and opts["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_self_draft_over_quantized_layers_keeps_greedy_output(quantization):
    """The draft runs the target's first layers, quantized; rejection keeps the target's
    greedy tokens (fp32 on the CPU: the verify computes what plain decoding computes)."""
    from graphexec import SpeculativeConfig

    opts = dict(device="cpu", max_batch=4, num_kv_blocks=64, quantization=quantization)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM("tiny", **opts) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM("tiny", speculative=SpeculativeConfig("self:1", 3), **opts) as llm:
        outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.num_drafted_tokens for o in outs) > 0
