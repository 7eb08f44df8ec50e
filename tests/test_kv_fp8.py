"""kv_cache_dtype="fp8" through the whole engine (CPU, the reference kernels): greedy output
equals transformers whose keys (after rope) and values are rounded to e4m3 the same way, and
the cache holds four times the fp32 blocks in the same memory."""
import copy

import pytest
import torch

from conftest import make_hf_model
from graphexec import LLM, Engine, SamplingParams
from graphexec.config import EngineConfig

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9]]


def _fp8(x):
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama-kv-fp8"))
    return d, make_hf_model(d, "llama")


def test_greedy_generation_matches_transformers_with_fp8_keys_and_values(hf_llama,
                                                                         monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    path, hf = hf_llama
    hf = copy.deepcopy(hf)
    rope = modeling.apply_rotary_pos_emb
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: (lambda q, k: (q, _fp8(k)))(
                            *rope(q, k, cos, sin, *a, **kw)))
    for layer in hf.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda mod, inp, out: _fp8(out))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=64,
             block_size=4, kv_cache_dtype="fp8") as llm:
        assert llm.engine.kv.k[0].dtype == torch.float8_e4m3fn
        outs = llm.generate(PROMPTS, params)
    dense = LLM(path, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=64,
                block_size=4).generate(PROMPTS, params)
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist()
    # the rounding is visible: fp8 keys and values change some greedy continuation
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, dense))


def test_fp8_cache_holds_more_blocks_in_the_same_memory():
    opts = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=128)
    dense, fp8 = Engine("tiny", **opts), Engine("tiny", kv_cache_dtype="fp8", **opts)
    assert fp8.pool.num_blocks == 4 * dense.pool.num_blocks
    assert fp8.kv.v[0].element_size() == 1


@pytest.mark.parametrize("value", ["fp16", "int8", None])
def test_bad_kv_cache_dtype_is_a_value_error(value):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="tiny", device="cpu", kv_cache_dtype=value)


def _add_kv_scales(path, scales):
    """The checkpoint at path with per-layer k_scale / v_scale tensors beside its weights, as
    llm-compressor saves an fp8 KV-cache scheme."""
    import os

    from safetensors.torch import load_file, save_file

    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    for i, (ks, vs) in enumerate(scales):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(ks)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(vs)
    save_file(tensors, f)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the scales go into the qk norms
def test_checkpoint_kv_scales_match_transformers_caching_k_and_v_over_them(tmp_path,
                                                                           monkeypatch, arch):
    """With k_scale / v_scale the cache holds fp8(k / k_scale) and fp8(v / v_scale): greedy
    output equals transformers rounding its keys and values that way (powers of two, so the
    scales folded into the projections change no other rounding)."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    path = str(tmp_path)
    hf = make_hf_model(path, arch)
    scales = [(4.0, 0.125), (0.5, 2.0)]  # per layer: large enough to move fp8's rounding
    _add_kv_scales(path, scales)
    current = {}
    rope = modeling.apply_rotary_pos_emb

    def rounded_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        ks = scales[current["layer"]][0]
        return q, _fp8(k / ks) * ks

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", rounded_rope)
    for i, layer in enumerate(hf.model.layers):
        vs = scales[i][1]
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, i=i: current.__setitem__("layer", i))
        layer.self_attn.v_proj.register_forward_hook(
            lambda mod, inp, out, vs=vs: _fp8(out / vs) * vs)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", max_batch=4, num_kv_blocks=64,
             block_size=4, kv_cache_dtype="fp8") as llm:
        outs = llm.generate(PROMPTS, params)
        # the cache holds v / v_scale: layer 0's values are 8x what v_proj gives
        assert llm.engine.kv.v[0].float().abs().max() > 4 * llm.engine.kv.v[1].float().abs().max()
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(p):].tolist()


def test_partial_kv_scales_are_a_value_error(tmp_path):
    path = str(tmp_path)
    make_hf_model(path, "llama")
    _add_kv_scales(path, [(1.0, 1.0)])  # layer 0 only
    with pytest.raises(ValueError, match="some layers only"):
        Engine(path, device="cpu", dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")


def test_async_equals_sync_on_an_fp8_cache_with_prefix_caching():
    from test_engine import _mixed_requests, _same, run_engine

    reqs = _mixed_requests(12, seed=2)
    opts = dict(device="cpu", max_batch=8, num_kv_blocks=128, kv_cache_dtype="fp8",
                enable_prefix_caching=True, quantization="int4")
    sync = run_engine(Engine("tiny", async_scheduling=False, **opts), reqs)
    _same(sync, run_engine(Engine("tiny", **opts), reqs))


def test_fp8_cache_under_pauses_and_a_self_draft():
    """Tight KV pauses and evicts rows (their KV rebuilt in e4m3 when they resume): async
    equals sync; and a self-draft over the e4m3 cache keeps plain greedy output."""
    from graphexec import SpeculativeConfig
    from test_engine import _mixed_requests, _same, run_engine

    reqs = _mixed_requests(12, seed=8)
    opts = dict(device="cpu", max_batch=8, num_kv_blocks=14, kv_cache_dtype="fp8")
    sync_engine = Engine("tiny", async_scheduling=False, **opts)
    sync = run_engine(sync_engine, reqs)
    s = sync_engine.stats_summary()
    assert s["pauses"] + s["evictions"] > 0
    _same(sync, run_engine(Engine("tiny", **opts), reqs))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", max_batch=4, num_kv_blocks=64, kv_cache_dtype="fp8")
    with LLM("tiny", **opts) as llm:
        plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM("tiny", speculative=SpeculativeConfig("self:1", 3), **opts) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == plain


def test_memory_figures_count_each_format():
    from graphexec.rank import memory_figures

    sizes = {}
    for q, kv in [(None, "auto"), ("fp8", "auto"), ("int4", "fp8")]:
        with LLM("tiny", device="cpu", dtype="bfloat16", num_kv_blocks=8, quantization=q,
                 kv_cache_dtype=kv) as llm:
            sizes[q] = memory_figures(llm.engine.model, llm.engine.kv)
    c = Engine("tiny", device="cpu", num_kv_blocks=8).model_config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim
    assert sizes[None]["kv_bytes_per_token"] == 2 * per_token  # bf16
    assert sizes["int4"]["kv_bytes_per_token"] == per_token  # e4m3
    layers = c.num_layers * c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size
                                             + 3 * c.intermediate_size)
    channels = c.num_layers * (c.q_size + 2 * c.kv_size + 2 * c.hidden_size
                               + 2 * c.intermediate_size)
    # fp8 saves a byte per projection weight and adds an fp32 scale per output channel
    saved = sizes[None]["weight_bytes"] - sizes["fp8"]["weight_bytes"]
    assert saved == layers - 4 * channels
    assert sizes["int4"]["weight_bytes"] < sizes["fp8"]["weight_bytes"]


def test_stats_summary_reports_the_bytes_of_each_format():
    """kv_bytes_per_token from the preset's shapes (K and V, every layer, each element's
    bytes); weight_bytes smaller once the projections are stored in fp8."""
    from graphexec import Engine
    from graphexec.model import preset

    mc = preset("tiny")
    per_elem_tokens = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    dense = Engine("tiny", device="cpu").stats_summary()
    fp8 = Engine("tiny", device="cpu", quantization="fp8", kv_cache_dtype="fp8").stats_summary()
    assert dense["kv_bytes_per_token"] == per_elem_tokens * 4  # fp32 on the CPU
    assert fp8["kv_bytes_per_token"] == per_elem_tokens
    assert fp8["weight_bytes"] < dense["weight_bytes"]
