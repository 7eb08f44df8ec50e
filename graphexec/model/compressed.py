"""Checkpoints quantized by llm-compressor, read as stored: config.json's quantization_config
with quant_method "compressed-tensors" (the format vLLM reads), in the two formats graphexec
runs: "float-quantized" (fp8 e4m3 weights, a scale per channel or per tensor) and
"pack-quantized" (4-bit integer weights, eight to an int32, a scale per group and, for the
asymmetric kind, zero points packed eight to an int32 along the output dim).

CompressedSource wraps a file format's TensorSource: a projection that the checkpoint stores
quantized (its `weight_scale` is there) comes back as a QuantizedWeight (kernels/quant.py),
sliced for a tensor-parallel rank with its scales; every other tensor is read as before.
Activation quantization in the scheme (FP8 W8A8 checkpoints) is not applied: the weights run as
W8A16, the activations in the model's dtype."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..kernels.quant import (PACK, PLANE_BLOCK, QuantizedWeight, pack_planes, plane_group,
                             unpack_int4)

FORMATS = {"float-quantized": ("float", 8, ("channel", "tensor")),
           "pack-quantized": ("int", 4, ("group", "channel"))}


@dataclass(frozen=True)
class CompressedScheme:
    format: str  # a key of FORMATS
    strategy: str  # channel, tensor (fp8) or group, channel (int4)
    group_size: int | None  # int4 groups along K; None for a channel or tensor scale
    symmetric: bool


def read_scheme(path: str) -> CompressedScheme | None:
    """The weights' scheme of the HF checkpoint at `path`, or None when it is not quantized; a
    ValueError naming the quant_method, format or weight argument graphexec does not run."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"model={path!r}: quant_method={method!r} is not supported; "
                         "graphexec reads 'compressed-tensors' checkpoints (float-quantized, "
                         "pack-quantized)")
    schemes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        schemes.add(_group_scheme(path, name, group, group.get("format") or qc.get("format")))
    if not schemes:
        raise ValueError(f"model={path!r}: quantization_config has no config_groups")
    if len(schemes) > 1:
        raise ValueError(f"model={path!r}: config_groups quantize weights in "
                         f"{len(schemes)} ways ({sorted(map(str, schemes))}); graphexec runs "
                         "one scheme per model")
    return schemes.pop()


def _group_scheme(path: str, name: str, group: dict, fmt) -> CompressedScheme:
    if fmt not in FORMATS:
        raise ValueError(f"model={path!r}: config_groups.{name} has format={fmt!r}; "
                         f"graphexec reads {sorted(FORMATS)}")
    w = group.get("weights") or {}
    kind, bits, strategies = FORMATS[fmt]
    got = (w.get("type"), w.get("num_bits"), w.get("strategy"))
    if got[0] != kind or got[1] != bits or got[2] not in strategies:
        raise ValueError(f"model={path!r}: config_groups.{name}.weights has type={got[0]!r}, "
                         f"num_bits={got[1]!r}, strategy={got[2]!r}; format {fmt!r} runs "
                         f"type={kind!r}, num_bits={bits}, strategy in {strategies}")
    symmetric = bool(w.get("symmetric", True))
    if kind == "float" and not symmetric:
        raise ValueError(f"model={path!r}: config_groups.{name}.weights: asymmetric fp8 "
                         "(symmetric=false) is not supported")
    group_size = w.get("group_size") if got[2] == "group" else None
    if got[2] == "group" and not plane_group(group_size):
        raise ValueError(f"model={path!r}: config_groups.{name}.weights.group_size="
                         f"{group_size!r} must be 16, 32 or a positive multiple of "
                         f"{PLANE_BLOCK}")
    return CompressedScheme(fmt, got[2], group_size, symmetric)


class CompressedSource:
    """A TensorSource (model/layer_walk.py) over `base` that reads quantized projections as
    QuantizedWeights. base: the safetensors source, which also gives tensors as stored (raw)."""

    def __init__(self, base, scheme: CompressedScheme, dtype: torch.dtype):
        self.base, self.scheme, self.dtype = base, scheme, dtype

    def _prefix(self, name: str) -> str | None:
        """The module of a quantized weight `name` (its prefix), or None."""
        if not name.endswith(".weight"):
            return None
        prefix = name[:-len("weight")]
        return prefix if self.base.has(prefix + "weight_scale") else None

    def has(self, name: str) -> bool:
        return self.base.has(name) or self._prefix(name) is not None

    def get(self, name: str, shape: tuple[int, ...], split: int | None = None):
        prefix = self._prefix(name)
        if prefix is None:
            return self.base.get(name, shape, split)
        qw = (self._fp8(prefix, shape) if self.scheme.format == "float-quantized"
              else self._int4(prefix, shape))
        shard = self.base.shard
        if split is None or not shard.sharded:
            return qw
        start, stop = shard.bounds(shape[split])
        return qw.rows(start, stop) if split == 0 else qw.cols(start, stop)

    def _raw(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
        t = self.base.raw(name)
        if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
            raise ValueError(f"model={self.base.path!r}: tensor {name!r} is {t.dtype} "
                             f"{tuple(t.shape)}, the {self.scheme.format} scheme implies "
                             f"{[str(d) for d in dtypes]} {tuple(shape)}")
        return t

    def _scale(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        floats = (torch.float32, torch.bfloat16, torch.float16)
        return self._raw(name, shape, floats).float()

    def _fp8(self, prefix: str, shape: tuple[int, int]) -> QuantizedWeight:
        n, _ = shape
        data = self._raw(prefix + "weight", shape, (torch.float8_e4m3fn,))
        if self.scheme.strategy == "channel":
            scale = self._scale(prefix + "weight_scale", (n, 1)).reshape(n)
        else:  # one scale for the tensor, given to every channel: one layout for the kernels
            s = self.base.raw(prefix + "weight_scale")
            scale = self._scale(prefix + "weight_scale", tuple(s.shape)).reshape(1).expand(n)
        return QuantizedWeight("fp8", data, scale.contiguous(), out_dtype=self.dtype)

    def _int4(self, prefix: str, shape: tuple[int, int]) -> QuantizedWeight:
        n, k = shape
        g = self.scheme.group_size or k  # channel: one group spans the row
        if k % g:
            raise ValueError(f"model={self.base.path!r}: {prefix}weight has {k} input "
                             f"columns, not a whole number of groups of {g}")
        stored = self.base.raw(prefix + "weight_shape").tolist()
        if stored != [n, k]:
            raise ValueError(f"model={self.base.path!r}: tensor {prefix + 'weight_shape'!r} "
                             f"says {stored}, the config implies {[n, k]}")
        packed = self._raw(prefix + "weight_packed", (n, k // PACK), (torch.int32,))
        data = pack_planes(unpack_int4(packed))  # K order to the kernels' plane order
        scale = self._scale(prefix + "weight_scale", (n, k // g))
        zero = None
        if not self.scheme.symmetric:  # eight zero points a word, along the output dim
            zeros = self._raw(prefix + "weight_zero_point", (n // PACK, k // g),
                              (torch.int32,))
            zero = unpack_int4(zeros.t().contiguous()).t().contiguous()
        return QuantizedWeight("int4", data, scale, zero, g, out_dtype=self.dtype)
