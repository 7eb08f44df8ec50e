"""Small GGUF files for the loader tests, written with gguf.GGUFWriter from HF models (the way
llama.cpp's converter lays them out), and a prefill that returns graphexec's logits."""
from __future__ import annotations

import numpy as np
import torch

# HF parameter name (after "model.layers.N.") -> GGUF tensor name (after "blk.N.")
LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}

# Where a K/IQ block keeps its fp16 scales (byte offsets), for random blocks that dequantize to
# finite values: the package can read these types but not write them.
_F16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ4_NL": (0,), "IQ4_XS": (0,)}


def to_llama_cpp_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's order for q/k rows: in each head, row i of the first half and row i of
    the second half become neighbours (rows 2i and 2i + 1)."""
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    order = [h * head_dim + part * half + i
             for h in range(n_heads) for i in range(half) for part in (0, 1)]
    return w[order]


def hf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's parameters under GGUF names, fp32, q/k rows permuted for llama."""
    cfg = model.config
    out = {}
    for name, p in model.state_dict().items():
        arr = p.detach().float().numpy().copy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            if rest not in LAYER_NAMES:
                continue
            gname = f"blk.{idx}.{LAYER_NAMES[rest]}"
            if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
                arr = to_llama_cpp_rows(arr, heads)
        elif name in TOP_NAMES:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            gname = TOP_NAMES[name]
        else:
            continue
        out[gname] = arr
    return out


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    out = []
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def encode_tensor(arr: np.ndarray, qtype: str, rng: np.random.Generator):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[qtype]
    if np.issubdtype(arr.dtype, np.integer):  # written as it is: I8 / I16 / I32
        return arr, None
    if qtype == "F32":
        return arr.astype(np.float32), None
    if qtype == "F16":
        return arr.astype(np.float16), None
    if qtype in _F16_FIELDS:
        block, size = gguf.GGML_QUANT_SIZES[t]
        rows, cols = arr.shape
        blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for off in _F16_FIELDS[qtype]:
            scale = rng.uniform(0.002, 0.02, size=blocks.shape[:2]).astype(np.float16)
            blocks[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
        return blocks.reshape(rows, -1), t
    return quantize(arr.astype(np.float32), t), t


def write_gguf(path: str, arch: str, cfg, tensors: dict[str, np.ndarray],
               types: dict[str, str] | None = None, seed: int = 0,
               tokenizer: bool = True) -> None:
    """cfg: an HF config (shapes, rope, eps). types: GGUF tensor name -> type (default F32)."""
    import gguf

    rng = np.random.default_rng(seed)
    types = types or {}
    w = gguf.GGUFWriter(path, arch)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        alphabet = byte_alphabet()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens = specials + alphabet
        merges = []
        pairs = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
        for a, b in pairs:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
        tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for name, arr in tensors.items():
        data, raw = encode_tensor(arr, types.get(name, "F32"), rng)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prefill_logits(model, prompt: list[int], block_size: int = 16,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """graphexec's logits at every position of one prompt (fp32 [T, vocab])."""
    from graphexec.model.llama import AttentionInputs, KVCache

    mc = model.config
    nblocks = -(-len(prompt) // block_size)
    shape = (nblocks, block_size, mc.num_kv_heads, mc.head_dim)
    kv = KVCache([torch.zeros(shape, dtype=dtype) for _ in range(mc.num_layers)],
                 [torch.zeros(shape, dtype=dtype) for _ in range(mc.num_layers)])
    n = len(prompt)
    attn = AttentionInputs(slot_mapping=torch.arange(n),
                           block_tables=torch.arange(nblocks)[None].int(),
                           seq_lens=torch.tensor([n]).int(),
                           cu_seqlens_q=torch.tensor([0, n]).int())
    with torch.no_grad():
        hidden = model.forward(torch.tensor(prompt), torch.arange(n), attn, kv)
        return model.compute_logits(hidden).float()
