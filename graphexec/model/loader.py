"""Weights: from a HuggingFace safetensors directory, or random for a preset."""
from __future__ import annotations

import glob
import json
import os

import torch

from .config import ModelConfig
from .llama import LayerWeights, ModelWeights


class _TensorSource:
    """Name -> tensor over one or many safetensors files, loaded straight to device and dtype."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            weight_map = {}
        if not files:
            raise ValueError(f"model={path!r}: no *.safetensors files in that directory")
        # safetensors wants a device string; cpu first when the target dtype differs, so a bf16
        # checkpoint loaded as fp32 never holds two copies on the GPU.
        self.handles = {fn: safe_open(os.path.join(path, fn), framework="pt", device="cpu")
                        for fn in files}
        if not weight_map:
            for fn, h in self.handles.items():
                for name in h.keys():
                    weight_map[name] = fn
        self.weight_map = weight_map
        self.path, self.device, self.dtype = path, device, dtype

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        fn = self.weight_map.get(name)
        if fn is None:
            raise ValueError(f"model={self.path!r}: tensor {name!r} is missing from the checkpoint")
        t = self.handles[fn].get_tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"model={self.path!r}: tensor {name!r} has shape {tuple(t.shape)}, "
                             f"the config implies {tuple(shape)}")
        return t.to(device=self.device, dtype=self.dtype)

    def has(self, name: str) -> bool:
        return name in self.weight_map


def load_weights(path: str, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> ModelWeights:
    src = _TensorSource(path, device, dtype)
    c = config
    hid, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        q = src.get(p + "self_attn.q_proj.weight", (c.q_size, hid))
        k = src.get(p + "self_attn.k_proj.weight", (c.kv_size, hid))
        v = src.get(p + "self_attn.v_proj.weight", (c.kv_size, hid))
        bias = None
        if c.qkv_bias:
            bias = torch.cat([src.get(p + "self_attn.q_proj.bias", (c.q_size,)),
                              src.get(p + "self_attn.k_proj.bias", (c.kv_size,)),
                              src.get(p + "self_attn.v_proj.bias", (c.kv_size,))])
        gate = src.get(p + "mlp.gate_proj.weight", (inter, hid))
        up = src.get(p + "mlp.up_proj.weight", (inter, hid))
        layers.append(LayerWeights(
            qkv=torch.cat([q, k, v]),
            o=src.get(p + "self_attn.o_proj.weight", (hid, c.q_size)),
            gate_up=torch.cat([gate, up]),
            down=src.get(p + "mlp.down_proj.weight", (hid, inter)),
            input_norm=src.get(p + "input_layernorm.weight", (hid,)),
            post_norm=src.get(p + "post_attention_layernorm.weight", (hid,)),
            qkv_bias=bias,
            q_norm=src.get(p + "self_attn.q_norm.weight", (hd,)) if c.qk_norm else None,
            k_norm=src.get(p + "self_attn.k_norm.weight", (hd,)) if c.qk_norm else None,
        ))
        del q, k, v, gate, up
    embed = src.get("model.embed_tokens.weight", (c.vocab_size, hid))
    if c.tie_word_embeddings or not src.has("lm_head.weight"):
        if not c.tie_word_embeddings:
            raise ValueError(f"model={path!r}: tensor 'lm_head.weight' is missing and "
                             "tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = src.get("lm_head.weight", (c.vocab_size, hid))
    return ModelWeights(embed=embed, layers=layers, norm=src.get("model.norm.weight", (hid,)),
                        lm_head=lm_head)


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> ModelWeights:
    """Normal(0, init_std) matrices, unit norms; made on the target device, one tensor at a time."""
    c = config
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
                * c.init_std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    layers = [LayerWeights(
        qkv=randn(c.q_size + 2 * c.kv_size, c.hidden_size),
        o=randn(c.hidden_size, c.q_size),
        gate_up=randn(2 * c.intermediate_size, c.hidden_size),
        down=randn(c.hidden_size, c.intermediate_size),
        input_norm=ones(c.hidden_size),
        post_norm=ones(c.hidden_size),
        qkv_bias=randn(c.q_size + 2 * c.kv_size) if c.qkv_bias else None,
        q_norm=ones(c.head_dim) if c.qk_norm else None,
        k_norm=ones(c.head_dim) if c.qk_norm else None,
    ) for _ in range(c.num_layers)]
    embed = randn(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else randn(c.vocab_size, c.hidden_size)
    return ModelWeights(embed=embed, layers=layers, norm=ones(c.hidden_size), lm_head=lm_head)
