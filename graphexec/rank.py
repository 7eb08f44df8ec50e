"""What one rank runs: its share of the weights, its KV cache, the model, the ModelRunner and its
graphs. The engine builds rank 0 here and each tensor-parallel worker builds its own rank with
the same code (graphexec/parallel/worker.py), so the ranks cannot drift apart in shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .config import EngineConfig
from .kernels import quantized_ops, select_ops
from .model import KVCache, LlamaModel, ModelConfig, ModelSource, load_model
from .model.quantize import is_quantized, weight_bytes
from .model.shard import UNSHARDED, Shard
from .plan import Variant
from .runner import ModelRunner
from .spec import build_draft


@dataclass
class Rank:
    config: ModelConfig  # the shape this rank computes (shard.config of the whole model's)
    kv: KVCache
    model: LlamaModel
    runner: ModelRunner
    num_blocks: int  # usable KV blocks (the cache holds one more: the scratch block)


def resolve_max_model_len(cfg: EngineConfig, mc: ModelConfig) -> int:
    max_len = cfg.max_model_len or min(mc.max_position_embeddings, 4096)
    if mc.sliding_window is not None:
        max_len = min(max_len, mc.sliding_window)  # no windowed attention: stay inside it
    if max_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={max_len} exceeds the model's "
                         f"max_position_embeddings={mc.max_position_embeddings}")
    return max_len


def build_rank(cfg: EngineConfig, source: ModelSource, max_len: int, shard: Shard = UNSHARDED,
               make_runner: Callable[..., ModelRunner] = ModelRunner) -> Rank:
    whole, weights = load_model(source, cfg.device, cfg.dtype, seed=cfg.seed, shard=shard,
                                quantization=cfg.quantization,
                                kv_cache_dtype=cfg.kv_cache_dtype)
    mc = shard.config(whole)
    num_blocks = _num_kv_blocks(cfg, mc, max_len)
    if shard.sharded:  # block ids are shared: every rank's cache has the smallest one's size
        num_blocks = _min_over_ranks(num_blocks, cfg.device)
    kv = _allocate_kv(mc, num_blocks + 1, cfg.block_size, cfg.kv_dtype, cfg.device)
    ops = select_ops(cfg.device, cfg.use_triton, cfg.projections, cfg.batch_invariant)
    if is_quantized(weights):  # online, or a quantized checkpoint's as stored
        if cfg.batch_invariant:
            raise ValueError(f"batch_invariant=True runs dense weights only; model="
                             f"{cfg.model!r} is quantized")
        ops = quantized_ops(ops, cfg.device, cfg.use_triton)
    # positions past the limit: the extra step after a finish, and K draft positions
    spec = cfg.speculative
    k = spec.num_tokens if spec is not None else 0
    model = LlamaModel(mc, weights, ops, max_positions=max_len + 2 + k, shard=shard)
    del weights  # under tensor parallelism model.weights holds the LM head's slice, not this
    draft = build_draft(spec, model, kv, max_len, cfg.seed) if spec is not None else None
    runner = make_runner(model, kv, cfg.max_batch, max_len, cfg.block_size,
                         scratch_block=num_blocks, draft=draft, num_spec_tokens=k,
                         token_buckets=cfg.token_buckets,
                         defer_masks=defers_masks(cfg, shard))
    if cfg.cuda_graphs:
        from .capture.graphs import GraphSet

        with_lp = (False, True) if cfg.capture_logprobs else (False,)
        variants = [Variant(lp, f) for lp in with_lp for f in (False, True)]
        if k:  # the all-greedy speculative iteration
            variants += [Variant(lp, False, sampled=False) for lp in with_lp]
        # penalties, logit bias, min_p, grammars (the scheduler sets filters with them when
        # some row samples; a speculative all-greedy batch has its own)
        sampled = (True, False) if k else (True,)
        variants += [Variant(lp, s, sampled=s, penalties=True, grammar=g) for lp in with_lp
                     for s in sampled for g in (False, True)]
        if not k:  # grammar rows without penalties skip their kernels
            variants += [Variant(lp, True, penalties=False, grammar=True) for lp in with_lp]
        # Every rank captures the same graphs in the same order: the all-reduces inside them
        # pair up across ranks.
        runner.graphs = GraphSet.capture(runner, cfg.buckets, variants, cfg.token_buckets,
                                         progress=shard.rank == 0)
    return Rank(mc, kv, model, runner, num_blocks)


def defers_masks(cfg: EngineConfig, shard: Shard) -> bool:
    """Whether grammar steps launch before the host has their masks (capture/mask_gate.py):
    on one CUDA device with graphs and without drafts. Only graphs wait; a speculative step
    masks in two places, and tensor-parallel workers in other processes cannot read rank 0's
    pinned memory. Each of those reads a grammar step before planning the next instead."""
    return (cfg.device.type == "cuda" and cfg.cuda_graphs and not shard.sharded
            and cfg.speculative is None)


def _min_over_ranks(n: int, device: torch.device) -> int:
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the default group: start-up, long timeout
    return int(t.item())


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * elem


def memory_figures(model: LlamaModel, kv: KVCache) -> dict[str, int]:
    """This rank's weight_bytes (what a decode step reads: projections as stored, scales
    included, the norms and the LM head) and kv_bytes_per_token (K and V of every layer in
    the cache's dtype), for stats_summary()."""
    k = kv.k[0] if kv.k else None
    per_token = 0 if k is None else kv_bytes_per_block(model.config, 1, k.dtype)
    return dict(weight_bytes=weight_bytes(model.weights), kv_bytes_per_token=per_token)


def _num_kv_blocks(cfg: EngineConfig, mc: ModelConfig, max_len: int) -> int:
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(mc, cfg.block_size, cfg.kv_dtype)
    if cfg.kv_cache_memory is not None:
        n = cfg.kv_cache_memory // per_block
        if n < 1:
            raise ValueError(f"kv_cache_memory={cfg.kv_cache_memory} bytes holds no block "
                             f"({per_block} bytes each)")
        return n
    full = cfg.max_batch * -(-max_len // cfg.block_size)  # every row at the context limit
    if cfg.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(cfg.device)
        budget = int(free * 0.6)
    else:
        budget = 2 << 30
    return max(1, min(full, budget // per_block))


def _allocate_kv(mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
    shape = (num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    kv = KVCache()
    for _ in range(mc.num_layers):
        kv.k.append(torch.zeros(shape, dtype=dtype, device=device))
        kv.v.append(torch.zeros(shape, dtype=dtype, device=device))
    return kv
