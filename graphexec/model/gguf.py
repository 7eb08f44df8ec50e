"""Llama-family models from a GGUF file (llama.cpp's format): config, weights, tokenizer metadata.

Tensors are dequantized on the host by the `gguf` package and stored in the engine's dtype: the
engine runs no quantized kernels, so a GGUF is only a compact way to ship the weights.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .config import ModelConfig, RopeScaling
from .layer_walk import TensorNames, walk_weights
from .llama import ModelWeights
from .shard import UNSHARDED, Shard

GGUF_MAGIC = b"GGUF"

# general.architecture -> ModelConfig.family. llama.cpp writes Mistral checkpoints as "llama".
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Tensor types the loader dequantizes (all through gguf.quants.dequantize).
LOADABLE_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
})


@dataclass
class GGUFFile:
    """An opened, validated GGUF: metadata values and tensors by name (memory-mapped)."""

    path: str
    arch: str
    fields: Any  # gguf.GGUFReader.fields: name -> ReaderField
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    def value(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"model={self.path!r}: metadata {key!r} cannot be read ({e})") from e

    def arch_value(self, key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{self.arch}.{key}"
        v = self.value(full, default)
        if required and v is None:
            raise ValueError(f"model={self.path!r}: metadata {full!r} is missing")
        return v


def open_gguf(path: str) -> GGUFFile:
    """Parses the header and checks what the loader relies on, so a bad file fails here, with
    its name, rather than half way through building the model."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"model={path!r}: not a GGUF file (it starts with {magic!r}, "
                         f"a GGUF starts with {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        # The reader reports a file cut short as a failed reshape or index: say what it means.
        raise ValueError(f"model={path!r}: unreadable GGUF, truncated or corrupt ({e})") from e
    size = os.path.getsize(path)
    tensors = {}
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size:
            raise ValueError(f"model={path!r}: truncated GGUF: tensor {t.name!r} ends at byte "
                             f"{t.data_offset + int(t.n_bytes)}, the file has {size}")
        tensors[t.name] = t
    gf = GGUFFile(path=path, arch="", fields=reader.fields, tensors=tensors)
    arch = gf.value("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"model={path!r}: unsupported architecture general.architecture="
                         f"{arch!r}: graphexec loads {sorted(SUPPORTED_GGUF_ARCHITECTURES)}")
    gf.arch = arch
    for t in tensors.values():
        if t.tensor_type.name not in LOADABLE_TYPES:
            raise ValueError(f"model={path!r}: tensor {t.name!r} has type {t.tensor_type.name}, "
                             f"which graphexec cannot load (supported: {sorted(LOADABLE_TYPES)})")
    return gf


# -- config -----------------------------------------------------------------------------------


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    p = gf.path
    num_heads = _uniform(gf, "attention.head_count", required=True)
    num_kv_heads = _uniform(gf, "attention.head_count_kv") or num_heads
    hidden = int(gf.arch_value("embedding_length", required=True))
    head_dim = int(gf.arch_value("attention.key_length") or hidden // num_heads)
    value_dim = gf.arch_value("attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ValueError(f"model={p!r}: {gf.arch}.attention.value_length={value_dim} differs "
                         f"from key_length={head_dim}, which graphexec does not support")
    rot = gf.arch_value("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"model={p!r}: {gf.arch}.rope.dimension_count={rot} is a partial "
                         f"rotary over head_dim={head_dim}, which graphexec does not support")
    scaling = gf.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"model={p!r}: {gf.arch}.rope.scaling.type={scaling!r} is not "
                         "supported (only none, or llama-3 frequency factors)")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"model={p!r}: tensor 'token_embd.weight' is missing")
    theta = float(gf.arch_value("rope.freq_base") or 10000.0)
    family = SUPPORTED_GGUF_ARCHITECTURES[gf.arch]
    return ModelConfig(
        vocab_size=int(embed.shape[1]),  # ggml order: [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(gf.arch_value("feed_forward_length", required=True)),
        num_layers=int(gf.arch_value("block_count", required=True)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(gf.arch_value("context_length") or 4096),
        rms_norm_eps=float(gf.arch_value("attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=theta,
        rope_scaling=_llama3_scaling(gf, head_dim, theta),
        tie_word_embeddings="output.weight" not in gf.tensors,
        qkv_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
        eos_token_ids=_eos_ids(gf),
        family=family,
    )


def _uniform(gf: GGUFFile, key: str, required: bool = False) -> int | None:
    """A per-model count that llama.cpp may also write per layer (then all must agree)."""
    v = gf.arch_value(key, required=required)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ValueError(f"model={gf.path!r}: {gf.arch}.{key} differs between layers "
                             f"({sorted(set(v))}), which graphexec does not support")
        v = v[0]
    return None if v is None else int(v)


def _eos_ids(gf: GGUFFile) -> tuple[int, ...]:
    # Llama 3 ends a chat turn with eot (<|eot_id|>) and a tool call with eom, not with eos.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = gf.value(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return tuple(ids)


# Llama 3.1+ ships its frequency scaling as a tensor of per-frequency divisors, not as the
# parameters that made it. Meta's checkpoints blend between low_freq_factor 1 and
# high_freq_factor 4; the blended band then pins original_max_position_embeddings down.
_LLAMA3_LOW, _LLAMA3_HIGH = 1.0, 4.0


def _llama3_scaling(gf: GGUFFile, head_dim: int, theta: float) -> RopeScaling | None:
    t = gf.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    from ..kernels.rope import rope_inv_freq

    divisors = torch.from_numpy(np.array(_dequantize(gf, t), dtype=np.float64)).reshape(-1)
    base = rope_inv_freq(head_dim, theta).double()
    if divisors.shape != base.shape:
        raise ValueError(f"model={gf.path!r}: tensor 'rope_freqs.weight' has {divisors.numel()} "
                         f"factors, head_dim={head_dim} needs {base.numel()}")
    factor = float(divisors.max())
    if factor == 1.0 and bool((divisors == 1.0).all()):
        return None
    origs = {8192}
    wavelen = 2 * math.pi / base
    blended = (divisors > 1.0 + 1e-6) & (divisors < factor * (1 - 1e-6))
    for d, w in zip(divisors[blended].tolist(), wavelen[blended].tolist()):
        smooth = (1 / d - 1 / factor) / (1 - 1 / factor)
        origs.add(round(w * (smooth * (_LLAMA3_HIGH - _LLAMA3_LOW) + _LLAMA3_LOW)))
    # the divisors went through fp32: prefer the round factor they were made from (8, 32)
    for f in dict.fromkeys([round(factor, 3), factor]):
        for orig in sorted(origs):
            cand = RopeScaling(factor=f, low_freq_factor=_LLAMA3_LOW,
                               high_freq_factor=_LLAMA3_HIGH, original_max_position_embeddings=orig)
            implied = base / rope_inv_freq(head_dim, theta, cand).double()
            if torch.allclose(implied, divisors, rtol=1e-4):
                return cand
    raise ValueError(f"model={gf.path!r}: tensor 'rope_freqs.weight' holds rope frequency "
                     "factors that match no llama-3 scaling graphexec knows")


# -- weights ----------------------------------------------------------------------------------


def _dequantize(gf: GGUFFile, t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"model={gf.path!r}: tensor {t.name!r} of type {t.tensor_type.name} "
                         f"cannot be dequantized ({e})") from e
    return arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from the half-split rotary layout to
    adjacent (even, odd) pairs; the engine rotates halves, so put the rows back."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class _GGUFTensors:
    gf: GGUFFile
    device: torch.device
    dtype: torch.dtype
    permute_heads: dict[str, int] = field(default_factory=dict)  # name suffix -> head count
    shard: Shard = UNSHARDED

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def get(self, name: str, shape: tuple[int, ...], split: int | None = None) -> torch.Tensor:
        """The tensor, or with `split` (a dim) this rank's slice of it. Quantized blocks span
        rows, so the whole tensor is dequantized on the host and sliced there: only the slice
        reaches the device."""
        t = self.gf.tensors.get(name)
        if t is None:
            raise ValueError(f"model={self.gf.path!r}: tensor {name!r} is missing")
        arr = _dequantize(self.gf, t)
        if tuple(arr.shape) != tuple(shape):
            raise ValueError(f"model={self.gf.path!r}: tensor {name!r} has shape "
                             f"{tuple(arr.shape)}, the metadata implies {tuple(shape)}")
        # F32 tensors come back as read-only views of the memory map: copy before torch owns it.
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=not arr.flags.writeable))
        for suffix, heads in self.permute_heads.items():
            if name.endswith(suffix):
                w = _unpermute_rope_rows(w, heads)
        return self.shard.part(w, split).to(device=self.device, dtype=self.dtype)


# llama.cpp's names for the same tensors.
GGUF_NAMES = TensorNames(
    layer="blk.{i}.",
    q="attn_q.weight", k="attn_k.weight", v="attn_v.weight",
    q_bias="attn_q.bias", k_bias="attn_k.bias", v_bias="attn_v.bias", o="attn_output.weight",
    gate="ffn_gate.weight", up="ffn_up.weight", down="ffn_down.weight",
    input_norm="attn_norm.weight", post_norm="ffn_norm.weight",
    q_norm="attn_q_norm.weight", k_norm="attn_k_norm.weight",
    embed="token_embd.weight", norm="output_norm.weight", lm_head="output.weight",
)


def load_gguf_weights(gf: GGUFFile, config: ModelConfig, device: torch.device,
                      dtype: torch.dtype, shard: Shard = UNSHARDED) -> ModelWeights:
    c = config
    permute = {}
    if gf.arch == "llama":  # qwen2/qwen3 convert without the permutation (neox rotary)
        permute = {".attn_q.weight": c.num_heads, ".attn_q.bias": c.num_heads,
                   ".attn_k.weight": c.num_kv_heads, ".attn_k.bias": c.num_kv_heads}
    src = _GGUFTensors(gf, device, dtype, permute, shard)
    return walk_weights(src, GGUF_NAMES, config, gf.path)


# -- tokenizer metadata -----------------------------------------------------------------------


@dataclass
class GGUFTokenizerData:
    """tokenizer.ggml.* and tokenizer.chat_template, as the file states them."""

    model: str  # "gpt2" (byte-level BPE), "llama" (sentencepiece), ...
    pre: str | None  # the pre-tokenizer (text splitting) the merges were learned with
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def tokenizer_data(gf: GGUFFile) -> GGUFTokenizerData | None:
    model = gf.value("tokenizer.ggml.model")
    tokens = gf.value("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        return None

    def opt_int(key: str) -> int | None:
        v = gf.value(f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    types = gf.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    return GGUFTokenizerData(
        model=model, pre=gf.value("tokenizer.ggml.pre"), tokens=list(tokens),
        token_types=[int(x) for x in types], merges=list(gf.value("tokenizer.ggml.merges") or []),
        bos_id=opt_int("bos_token_id"), eos_id=opt_int("eos_token_id"),
        eot_id=opt_int("eot_token_id"),
        add_bos=bool(gf.value("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(gf.value("tokenizer.ggml.add_eos_token", False)),
        chat_template=gf.value("tokenizer.chat_template"),
    )

