"""Tensor parallelism (EngineConfig.tensor_parallel_size): one process per rank, Megatron-style
shards (graphexec/model/shard.py), rank 0 running the host loop and sending each launch to the
others. docs/architecture.md, "Tensor parallelism", has the design."""
from __future__ import annotations

from functools import partial

from ..config import EngineConfig
from ..model import ModelConfig, ModelSource
from ..model.shard import Shard
from ..rank import Rank, build_rank
from .runner import TensorParallelRunner
from .workers import TensorParallelError, WorkerGroup

__all__ = ["TensorParallelError", "TensorParallelRunner", "WorkerGroup", "build_ranks"]


def build_ranks(cfg: EngineConfig, source: ModelSource, mc: ModelConfig,
                max_len: int) -> tuple[Rank, WorkerGroup | None]:
    """Builds rank 0 here; at tensor_parallel_size > 1 first starts the workers, which build the
    other ranks meanwhile. The caller closes the WorkerGroup."""
    size = cfg.tensor_parallel_size
    if size == 1:
        return build_rank(cfg, source, max_len), None
    Shard(0, size).check(mc, cfg.model)  # before any process starts
    workers = WorkerGroup.start(cfg)
    try:
        with workers.watch():
            rank = build_rank(cfg, source, max_len, workers.shard,
                              partial(TensorParallelRunner, workers=workers))
    except BaseException:
        workers.close()
        raise
    return rank, workers
