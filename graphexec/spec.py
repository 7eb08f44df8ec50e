"""Speculative decoding configuration and the draft model it builds."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .capture.spec_iteration import DraftModel
from .model import KVCache, LlamaModel, ModelWeights, load_model, resolve_model

MAX_SPEC_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """draft: "self:N" (the target's first N layers, its final norm and LM head, sharing the
    target's KV cache for those layers), a preset name, a HuggingFace model directory or a GGUF
    file with the target's vocabulary. num_tokens: K, the tokens drafted per step (1..8)."""

    draft: str
    num_tokens: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.draft, str) or not self.draft:
            raise ValueError(f"draft must be 'self:N', a preset or a model directory, "
                             f"got {self.draft!r}")
        k = self.num_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_tokens must be an integer in [1, {MAX_SPEC_TOKENS}], got {k!r}")


def build_draft(spec: SpeculativeConfig, target: LlamaModel, target_kv: KVCache,
                max_model_len: int, seed: int) -> DraftModel:
    tc = target.config
    if spec.draft.startswith("self:"):
        try:
            n = int(spec.draft[5:])
        except ValueError:
            raise ValueError(f"draft={spec.draft!r}: expected self:N with N an integer") from None
        if not 1 <= n <= tc.num_layers:
            raise ValueError(f"draft={spec.draft!r}: N must be in [1, {tc.num_layers}] "
                             "(the target's layers)")
        w = target.weights
        weights = ModelWeights(embed=w.embed, layers=w.layers[:n], norm=w.norm,
                               lm_head=w.lm_head)
        model = LlamaModel(replace(tc, num_layers=n), weights, target.ops,
                           max_positions=target.cos.shape[0], shard=target.shard)
        return DraftModel(model, KVCache(target_kv.k[:n], target_kv.v[:n]),
                          shares_target_kv=True)
    device, dtype = target.device, target.dtype
    # an HF dir, a GGUF file or a shipped model's name; a preset gets random weights. Under
    # tensor parallelism the draft is split over the ranks like the target.
    shard = target.shard
    dc, weights = load_model(resolve_model(spec.draft), device, dtype, seed=seed + 1,
                             shard=shard)
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(f"draft={spec.draft!r} has vocab_size={dc.vocab_size}, the target "
                         f"has {tc.vocab_size}: they must share the vocabulary")
    if dc.max_position_embeddings < max_model_len:
        raise ValueError(f"draft={spec.draft!r} supports {dc.max_position_embeddings} "
                         f"positions, less than max_model_len={max_model_len}")
    dc = shard.config(dc)
    model = LlamaModel(dc, weights, target.ops, max_positions=target.cos.shape[0], shard=shard)
    shape = (target_kv.k[0].shape[0], target_kv.k[0].shape[1], dc.num_kv_heads, dc.head_dim)
    kv = KVCache([torch.zeros(shape, dtype=dtype, device=device) for _ in range(dc.num_layers)],
                 [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dc.num_layers)])
    return DraftModel(model, kv, shares_target_kv=False)
