"""Online quantization at load (EngineConfig.quantization): each layer's qkv, o, gate_up and
down projection becomes a QuantizedWeight (kernels/quant.py), round to nearest; embeddings,
norms and the LM head stay in the activation dtype. Under tensor parallelism a rank quantizes
its own slice: int4 groups are then the whole model's groups as long as no group straddles two
ranks (checked), while an fp8 row-parallel projection (o, down) takes each channel's scale over
the rank's columns, a finer scale than one GPU's."""
from __future__ import annotations

import torch

from ..kernels.quant import (DEFAULT_GROUP_SIZE, QuantizedWeight, quantize_fp8,
                             quantize_int4)
from .llama import ModelWeights

# EngineConfig.quantization: None or "none" keeps the checkpoint's weights as they are
QUANTIZATIONS = ("none", "fp8", "int4", "int4_asym")
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def check_quantization(value) -> str | None:
    """The method, or None for dense weights; a ValueError naming anything else."""
    if value is None or value == "none":
        return None
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization={value!r} is not one of {QUANTIZATIONS} or None")
    return value


def quantize_tensor(w: torch.Tensor, method: str,
                    group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedWeight:
    if method == "fp8":
        return quantize_fp8(w)
    k = w.shape[1]
    if k % group_size:
        raise ValueError(f"quantization={method!r}: a projection's input dim of {k} (its "
                         f"share under tensor parallelism) is not a whole number of groups of "
                         f"{group_size}; under tensor parallelism a group would straddle two "
                         "ranks")
    return quantize_int4(w, group_size, symmetric=method == "int4")


def quantize_weights(weights: ModelWeights, method: str | None,
                     group_size: int = DEFAULT_GROUP_SIZE) -> ModelWeights:
    """The layers' projections quantized one at a time, in place (the dense tensor of one
    projection is freed before the next is made). A weight that is quantized already (a
    checkpoint's) is kept as stored. group_size: int4's (tools; the option uses 128)."""
    if method is None:
        return weights
    for layer in weights.layers:
        for name in PROJECTIONS:
            w = getattr(layer, name)
            if not isinstance(w, QuantizedWeight):
                setattr(layer, name, quantize_tensor(w, method, group_size))
    return weights


def is_quantized(weights: ModelWeights) -> bool:
    return any(isinstance(getattr(layer, name), QuantizedWeight)
               for layer in weights.layers for name in PROJECTIONS)


def weight_bytes(weights: ModelWeights) -> int:
    """The bytes a decode step reads for weights: every projection as stored, the norms and the
    LM head (the embedding rows gathered are negligible; a tied table counts once)."""
    total = _nbytes(weights.lm_head) + _nbytes(weights.norm)
    for layer in weights.layers:
        total += sum(_nbytes(t) for t in (
            layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm,
            layer.qkv_bias, layer.q_norm, layer.k_norm))
    return total


def _nbytes(t) -> int:
    if t is None:
        return 0
    return t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()


__all__ = ["QUANTIZATIONS", "check_quantization", "quantize_weights", "is_quantized",
           "weight_bytes"]
