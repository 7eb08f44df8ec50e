"""One tensor-parallel rank's share of a preset, as a model of its own for one GPU: the model
name `<preset>-tp<N>rank` (e.g. `llama-8b-tp2rank`) in tools/bench.py decode and
tools/profile_step.py.

Such a model has a rank's heads, KV heads, MLP width and vocabulary slice (graphexec/model/
shard.py) and none of the collectives, so its step against the real size-N step is what the
all-reduces, the logits' gather and the waits between ranks cost, and its kernel profile is a
rank's (docs/benchmarks.md "Tensor parallelism", measured 2026-11-26). Its norms run as their
own kernels where a rank's all-reduce would fuse them. The preset is registered in this process
only: it runs at tensor_parallel_size 1, whose engine has no worker processes.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from graphexec.model.config import PRESETS, preset  # noqa: E402
from graphexec.model.shard import Shard  # noqa: E402

_RANK_NAME = re.compile(r"(?P<base>.+)-tp(?P<size>[0-9]+)rank")


def register(name: str) -> str:
    """name, after adding it to the presets if it names a rank's share (module docstring).
    ValueError for a size below 2, or one that does not divide the preset's heads, KV heads,
    MLP width or vocabulary."""
    match = _RANK_NAME.fullmatch(name)
    if match is None or name in PRESETS:
        return name
    base, size = match["base"], int(match["size"])
    if size < 2:
        raise ValueError(f"model={name!r}: a rank's share needs a size of at least 2, got {size}")
    mc = preset(base)
    shard = Shard(rank=0, size=size)
    shard.check(mc, base)
    if not shard.splits_vocab(mc.vocab_size):
        raise ValueError(f"model={name!r}: size {size} does not divide "
                         f"vocab_size={mc.vocab_size}")
    PRESETS[name] = replace(shard.config(mc), vocab_size=mc.vocab_size // size)
    return name


def is_rank_share(name: str) -> bool:
    return _RANK_NAME.fullmatch(name) is not None
