"""The speculative decode iteration: K draft steps, one target verify over K+1 positions per
row, rejection sampling, advance by the accepted count. Like the plain iteration it reads and
writes only DecodeState, so it is captured per bucket and replayed with no host input.

The verify reuses paged *decode* attention: row r's K+1 queries become K+1 virtual rows that
share r's block table, each attending up to its own position. Every K/V is written before any
attention reads it, so the virtual rows see exactly the causal context they should.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.rejection import (SALT_DRAFT, accept_argmaxes, draw_from_probs,
                                 rejection_sample_ref, sampling_probs_ref)
from ..model.llama import AttentionInputs, KVCache, LlamaModel
from .state import DecodeState, Variant


@dataclass
class DraftModel:
    model: LlamaModel
    kv: KVCache
    shares_target_kv: bool  # self-drafting: the target's first layers and their cache


def _slots(state: DecodeState, bucket: int, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """pos: [bucket, n] positions -> flat cache slots through each row's block table."""
    col = (pos // block_size).clamp(max=state.max_cols - 1)
    block = state.block_tables[:bucket].gather(1, col).long()
    return block * block_size + pos % block_size


def _masked(model: LlamaModel, state: DecodeState, logits: torch.Tensor, bucket: int,
            steps: torch.Tensor) -> torch.Tensor:
    rows = slice(0, bucket)
    return model.ops.mask_stop_tokens(logits, state.stop_ids[rows], steps,
                                      state.min_tokens[rows], inplace=True)


def spec_iteration(target: LlamaModel, draft: DraftModel, state: DecodeState, kv: KVCache,
                   bucket: int, block_size: int, k: int, variant: Variant) -> None:
    rows = slice(0, bucket)
    pos0 = state.positions[rows]
    steps = state.steps[rows]
    temp, top_k, top_p = state.temperature[rows], state.top_k[rows], state.top_p[rows]
    seeds = state.seeds[rows]
    bt = state.block_tables[rows]

    # 1. draft: K tokens per row, each drawn from the draft's distribution q_j
    tok = state.input_ids[rows]
    drafts, qs = [], []
    n_draft_forwards = k if draft.shares_target_kv else k + 1  # +1 writes d_K's draft KV
    for j in range(n_draft_forwards):
        pos = pos0 + j
        attn = AttentionInputs(slot_mapping=_slots(state, bucket, pos[:, None], block_size)[:, 0],
                               block_tables=bt, seq_lens=(pos + 1).to(torch.int32),
                               rows_are_sequences=True)
        hidden = draft.model.forward(tok, pos, attn, draft.kv)
        if j == k:
            break
        logits = _masked(draft.model, state, draft.model.compute_logits(hidden), bucket,
                         steps + j)
        if variant.sampled:
            q = sampling_probs_ref(logits, temp, top_k, top_p, variant.filters)
            tok = draw_from_probs(q, seeds ^ SALT_DRAFT, steps + j)
            qs.append(q)
        else:  # every row greedy: q would be one-hot on the argmax
            tok = draft.model.ops.argmax(logits)
        drafts.append(tok)
    draft_tokens = torch.stack(drafts, dim=1)  # [B, K]

    # 2. verify: the target over [input, d_1..d_K] at positions pos0..pos0+K
    offs = torch.arange(k + 1, device=state.device)
    pos = pos0[:, None] + offs[None, :]
    ids = torch.cat([state.input_ids[rows][:, None], draft_tokens], dim=1)
    attn = AttentionInputs(slot_mapping=_slots(state, bucket, pos, block_size).reshape(-1),
                           block_tables=bt.repeat_interleave(k + 1, dim=0),
                           seq_lens=(pos + 1).reshape(-1).to(torch.int32))
    hidden = target.forward(ids.reshape(-1), pos.reshape(-1), attn, kv)
    raw = target.compute_logits(hidden)  # [B*(K+1), V]
    rep = lambda x: x.repeat_interleave(k + 1, dim=0)
    step_all = (steps[:, None] + offs[None, :]).reshape(-1)
    logits = target.ops.mask_stop_tokens(raw, rep(state.stop_ids[rows]), step_all,
                                         rep(state.min_tokens[rows]),
                                         inplace=not variant.logprobs)

    # 3. accept a prefix, add one corrected or bonus token
    if variant.sampled:
        p = sampling_probs_ref(logits, rep(temp), rep(top_k), rep(top_p), variant.filters)
        tokens, count = rejection_sample_ref(p.view(bucket, k + 1, -1), torch.stack(qs, dim=1),
                                             draft_tokens, seeds, steps)
    else:
        tokens, count = accept_argmaxes(target.ops.argmax(logits).view(bucket, k + 1),
                                        draft_tokens)
    state.out_tokens[rows] = tokens
    state.out_count[rows] = count
    if variant.logprobs:
        chosen, top_vals, top_ids = target.ops.logprobs(raw, tokens.reshape(-1),
                                                        state.out_top_ids.shape[-1])
        state.out_logprob[rows] = chosen.view(bucket, k + 1)
        state.out_top_logprobs[rows] = top_vals.view(bucket, k + 1, -1)
        state.out_top_ids[rows] = top_ids.view(bucket, k + 1, -1)

    # 4. advance live rows by the emitted count; the last emitted token is the next input
    live = (torch.arange(bucket, device=state.device) < state.num_rows).long()
    last = tokens.gather(1, (count - 1)[:, None]).squeeze(1)
    state.input_ids[rows] = last * live
    state.positions[rows] += count * live
    state.steps[rows] += count * live
