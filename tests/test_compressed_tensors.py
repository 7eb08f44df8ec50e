"""compressed-tensors checkpoints, written by that library, load as stored to the same
dequantized weights the library decompresses them to, and generate what transformers generates
with those weights; other quantization configs are refused by name."""
import copy
import json
import os

import pytest
import torch

pytest.importorskip("compressed_tensors")

from ct_helpers import SCHEMES, write_ct_checkpoint  # noqa: E402
from graphexec import LLM, SamplingParams  # noqa: E402
from graphexec.model import load_model, resolve_model  # noqa: E402
from graphexec.model.shard import Shard  # noqa: E402
from graphexec.kernels.quant import QuantizedWeight, dequantize  # noqa: E402

FORMAT = {"FP8_DYNAMIC": "fp8", "FP8": "fp8", "W4A16": "int4", "W4A16_ASYM": "int4"}


def _library_stacks(lib: dict, i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    get = lambda n: lib[p + n]
    return {"qkv": torch.cat([get("self_attn.q_proj"), get("self_attn.k_proj"),
                              get("self_attn.v_proj")]),
            "o": get("self_attn.o_proj"),
            "gate_up": torch.cat([get("mlp.gate_proj"), get("mlp.up_proj")]),
            "down": get("mlp.down_proj")}


@pytest.fixture(scope="module", params=list(SCHEMES))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param.lower()))
    # groups of 32 give the 128-wide projections several groups each
    group = 32 if request.param.startswith("W4") else None
    dense, lib = write_ct_checkpoint(path, request.param, group_size=group)
    return request.param, path, dense, lib


def test_loads_to_the_library_dequantized_weights(checkpoint):
    scheme, path, _, lib = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "compressed-tensors"
    _, weights = load_model(resolve_model(path), torch.device("cpu"), torch.float32)
    for i, layer in enumerate(weights.layers):
        for name, want in _library_stacks(lib, i).items():
            got = getattr(layer, name)
            assert isinstance(got, QuantizedWeight) and got.format == FORMAT[scheme]
            assert (got.zero is not None) == scheme.endswith("ASYM")
            torch.testing.assert_close(dequantize(got, torch.float32), want, rtol=0,
                                       atol=1e-6)
    assert not isinstance(weights.lm_head, QuantizedWeight)  # "ignore": ["lm_head"]


def test_greedy_generation_matches_transformers_on_library_weights(checkpoint):
    scheme, path, dense, lib = checkpoint
    hf = copy.deepcopy(dense)
    with torch.no_grad():
        for name, m in hf.named_modules():
            if name in lib:
                m.weight.copy_(lib[name])
    prompts = [[5, 17, 99, 3, 250, 41, 7], [300, 4, 4, 8, 19]]
    with LLM(path, device="cpu", dtype="float32", max_batch=2, num_kv_blocks=32,
             block_size=4) as llm:  # no quantization= needed: the checkpoint says so
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                    ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist(), scheme


def test_a_rank_holds_its_channels_and_groups(checkpoint):
    scheme, path, _, lib = checkpoint
    want = _library_stacks(lib, 0)
    src = resolve_model(path)
    for rank in range(2):
        shard = Shard(rank=rank, size=2)
        _, weights = load_model(src, torch.device("cpu"), torch.float32, shard=shard)
        layer = weights.layers[0]
        # o and down split by input columns: a rank's columns, whole groups, same scales
        for name in ("o", "down"):
            lo, hi = shard.bounds(want[name].shape[1])
            torch.testing.assert_close(dequantize(getattr(layer, name), torch.float32),
                                       want[name][:, lo:hi], rtol=0, atol=1e-6)
        lo, hi = shard.bounds(want["gate_up"].shape[0] // 2)  # this rank's gate rows
        torch.testing.assert_close(dequantize(layer.gate_up, torch.float32)[:hi - lo],
                                   want["gate_up"][lo:hi], rtol=0, atol=1e-6)


def _rewrite_quantization_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    qc = cfg["quantization_config"]
    for key, value in changes.items():
        target = qc
        *parents, leaf = key.split(".")
        for part in parents:
            target = target[part]
        target[leaf] = value
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("change, match", [
    ({"quant_method": "gptq"}, "quant_method='gptq'"),
    ({"config_groups.group_0.format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
    ({"config_groups.group_0.weights.strategy": "block"}, "strategy='block'"),
])
def test_other_schemes_are_value_errors(tmp_path, change, match):
    path = str(tmp_path)
    write_ct_checkpoint(path, "FP8_DYNAMIC")
    _rewrite_quantization_config(path, **change)
    with pytest.raises(ValueError, match=match):
        load_model(resolve_model(path), torch.device("cpu"), torch.float32)


def test_a_group_across_two_ranks_is_a_value_error(tmp_path):
    path = str(tmp_path)
    write_ct_checkpoint(path, "W4A16")  # groups of 128: o's 128 columns are one group
    with pytest.raises(ValueError, match="split a group"):
        load_model(resolve_model(path), torch.device("cpu"), torch.float32,
                   shard=Shard(rank=0, size=2))


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16"])
def test_a_quantized_lm_head_runs_as_stored(tmp_path, scheme):
    """A checkpoint that quantized its LM head too (no "ignore"): the head is a
    QuantizedWeight, and greedy output equals transformers on the library's weights."""
    path = str(tmp_path)
    dense, lib = write_ct_checkpoint(path, scheme, ignore=())
    assert "lm_head" in lib
    _, weights = load_model(resolve_model(path), torch.device("cpu"), torch.float32)
    assert isinstance(weights.lm_head, QuantizedWeight)
    hf = copy.deepcopy(dense)
    with torch.no_grad():
        for name, m in hf.named_modules():
            if name in lib:
                m.weight.copy_(lib[name])
    prompt = [5, 17, 99, 3, 250, 41, 7]
    with LLM(path, device="cpu", dtype="float32", num_kv_blocks=16, block_size=4) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                    ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, len(prompt):].tolist()
