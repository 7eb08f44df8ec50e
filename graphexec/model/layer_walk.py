"""The one walk over a checkpoint's tensors that builds ModelWeights. A file format (safetensors,
GGUF) supplies only its tensor names and a TensorSource that finds, converts and slices one
tensor; which tensors exist, their shapes, how they are stacked and sharded is decided here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..kernels.quant import QuantizedWeight, cat_rows
from .config import ModelConfig
from .llama import LayerWeights, ModelWeights
from .shard import COLUMN_PARALLEL, ROW_PARALLEL


class TensorSource(Protocol):
    def get(self, name: str, shape: tuple[int, ...], split: int | None = None) -> torch.Tensor:
        """The tensor on the target device and dtype, or with `split` (a dim) this rank's slice
        of it; a ValueError naming the file when it is missing or has another shape."""

    def has(self, name: str) -> bool: ...


@dataclass(frozen=True)
class TensorNames:
    """A format's name for each tensor. `layer` is a layer's prefix ({i}: its index); the names
    q to k_norm follow it."""

    layer: str
    q: str
    k: str
    v: str
    q_bias: str
    k_bias: str
    v_bias: str
    o: str
    gate: str
    up: str
    down: str
    input_norm: str
    post_norm: str
    q_norm: str
    k_norm: str
    embed: str
    norm: str
    lm_head: str


def walk_weights(src: TensorSource, names: TensorNames, config: ModelConfig,
                 path: str) -> ModelWeights:
    """Every weight of `config`'s model read from `src` (`path`: the model, for errors)."""
    c, n = config, names
    hid, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    col, row = COLUMN_PARALLEL, ROW_PARALLEL
    layers = []
    for i in range(c.num_layers):
        p = n.layer.format(i=i)
        q = src.get(p + n.q, (c.q_size, hid), col)
        k = src.get(p + n.k, (c.kv_size, hid), col)
        v = src.get(p + n.v, (c.kv_size, hid), col)
        bias = None
        if c.qkv_bias:
            bias = torch.cat([src.get(p + n.q_bias, (c.q_size,), col),
                              src.get(p + n.k_bias, (c.kv_size,), col),
                              src.get(p + n.v_bias, (c.kv_size,), col)])
        gate = src.get(p + n.gate, (inter, hid), col)
        up = src.get(p + n.up, (inter, hid), col)
        layers.append(LayerWeights(
            qkv=_stack([q, k, v]),
            o=src.get(p + n.o, (hid, c.q_size), row),
            gate_up=_stack([gate, up]),
            down=src.get(p + n.down, (hid, inter), row),
            input_norm=src.get(p + n.input_norm, (hid,)),
            post_norm=src.get(p + n.post_norm, (hid,)),
            qkv_bias=bias,
            q_norm=src.get(p + n.q_norm, (hd,)) if c.qk_norm else None,
            k_norm=src.get(p + n.k_norm, (hd,)) if c.qk_norm else None,
        ))
        del q, k, v, gate, up  # the parts go before the next layer's are read
    embed = src.get(n.embed, (c.vocab_size, hid))
    if c.tie_word_embeddings or not src.has(n.lm_head):
        if not c.tie_word_embeddings:
            raise ValueError(f"model={path!r}: tensor {n.lm_head!r} is missing and "
                             "tie_word_embeddings is false")
        lm_head = embed
    else:
        lm_head = src.get(n.lm_head, (c.vocab_size, hid))
    return ModelWeights(embed=embed, layers=layers, norm=src.get(n.norm, (hid,)),
                        lm_head=lm_head)


def _stack(parts: list) -> torch.Tensor | QuantizedWeight:
    """Projections stacked by output rows (q, k, v; gate, up), dense or quantized alike."""
    quantized = [isinstance(p, QuantizedWeight) for p in parts]
    if all(quantized):
        return cat_rows(parts)
    if any(quantized):
        raise ValueError("the projections stacked into one (q, k, v or gate, up) are "
                         "quantized in some parts and dense in others")
    return torch.cat(parts)
