"""A checkpoint's KV-cache scales (k_scale, v_scale per layer, as llm-compressor writes them
for an fp8 cache) folded into the projections at load, so the cache holds k / k_scale and
v / v_scale and no kernel needs a scale of its own:

- k / k_scale: the k rows of qkv (and their bias) divided by it, or with a qk-norm the k norm's
  weight (the norm would undo a scale before it); q multiplied by it the same way, so q . k
  and the attention scores are unchanged;
- v / v_scale: the v rows divided by it, and the o projection multiplied by it (o is linear in
  the attention output, a weighted sum of values).

A quantized projection takes the factor into its channel scales (QuantizedWeight.scaled).
Without the tensors the scales are 1.0 and nothing changes."""
from __future__ import annotations

import torch

from ..kernels.quant import QuantizedWeight
from .config import ModelConfig
from .llama import ModelWeights

NAMES = ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale")


def read_kv_scales(src, config: ModelConfig, path: str) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) of each layer from a TensorSource with raw() (model/loader.py), or
    None when the checkpoint has none; a ValueError for a partial set or a bad value."""
    names = [n.format(i=i) for i in range(config.num_layers) for n in NAMES]
    present = [src.has(n) for n in names]
    if not any(present):
        return None
    if not all(present):
        missing = [n for n, p in zip(names, present) if not p]
        raise ValueError(f"model={path!r}: the checkpoint has KV-cache scales for some layers "
                         f"only; missing {missing[:4]}")
    values = []
    for n in names:
        t = src.raw(n).float()
        if t.numel() != 1 or not torch.isfinite(t).all() or float(t) <= 0:
            raise ValueError(f"model={path!r}: tensor {n!r} must be one positive scale "
                             f"(per-tensor KV scales), got shape {tuple(t.shape)}")
        values.append(float(t))
    return list(zip(values[0::2], values[1::2]))


def _rows(w, factors: torch.Tensor):
    if isinstance(w, QuantizedWeight):
        return w.scaled(factors)
    return w * factors.to(w.device, w.dtype)[:, None]


def fold_kv_scales(weights: ModelWeights, config: ModelConfig,
                   scales: list[tuple[float, float]]) -> ModelWeights:
    """weights (of the shape `config`: a rank's share) with each layer's scales folded in."""
    c = config
    for layer, (ks, vs) in zip(weights.layers, scales):
        qkv_factors = torch.ones(c.q_size + 2 * c.kv_size)
        if c.qk_norm:  # the norms set q's and k's size: scale their weights instead
            layer.q_norm = layer.q_norm * ks
            layer.k_norm = layer.k_norm / ks
        else:
            qkv_factors[:c.q_size] = ks
            qkv_factors[c.q_size:c.q_size + c.kv_size] = 1 / ks
        qkv_factors[c.q_size + c.kv_size:] = 1 / vs
        layer.qkv = _rows(layer.qkv, qkv_factors)
        if layer.qkv_bias is not None:
            layer.qkv_bias = layer.qkv_bias * qkv_factors.to(layer.qkv_bias)
        layer.o = _rows(layer.o, torch.full((layer.o.shape[0],), vs))
    return weights
