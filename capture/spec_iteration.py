"""The speculative decode iteration: K draft steps, one target verify over K+1 positions per
row, rejection sampling, advance by the accepted count. Like the plain iteration it reads and
writes only DecodeState, so it is captured per bucket and replayed with no host input.

The verify reuses paged *decode* attention: row r's K+1 queries become K+1 virtual rows that
share r's block table, each attending up to its own position. Every K/V is written before any
attention reads it, so the virtual rows see exactly the causal context they should.

A self-draft (the target's first N layers, on the target's KV cache) has already run the
target's first N layers for every position the verify checks: draft step j took the token at
pos0 + j through them, attending to the KV those layers hold for the positions before it, which
is the target's computation of that position up to layer N (the LayerSkip paper's reuse of the
draft's work in verification). So the verify starts at layer N from the draft steps' states,
and a (K + 1)-th draft forward, without logits, brings d_K to layer N. The verify reads each
weight once either way; what changes is that the target's first N layers (and their KV) run
on the draft's kernels, which round exactly like plain decoding at the same batch size, instead
of being recomputed over B * (K + 1) rows by kernels that round differently.

Grammar rows, penalties, logit bias and min_p (the `penalties` variant) are applied at every
verified position as the plain sampler would apply them there (capture/spec_controls.py);
grammar rows take no drafts. Other variants launch none of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.rejection import (SALT_DRAFT, accept_argmaxes, draw_from_probs,
                                 rejection_sample_ref, sampling_probs_ref)
from ..model.llama import AttentionInputs, FinalHidden, KVCache, LlamaModel
from ..plan import Variant
from .spec_controls import Hold, apply_controls, recount, repeat_rows
from .state import DecodeState


@dataclass
class DraftModel:
    model: LlamaModel
    kv: KVCache
    shares_target_kv: bool  # self-drafting: the target's first layers and their cache


def _masked(model: LlamaModel, state: DecodeState, logits: torch.Tensor, bucket: int,
            steps: torch.Tensor) -> torch.Tensor:
    rows = slice(0, bucket)
    return model.ops.mask_stop_tokens(logits, state.stop_ids[rows], steps,
                                      state.min_tokens[rows], inplace=True)


def _interleave(states: list[FinalHidden]) -> FinalHidden:
    """Draft steps' [B, H] states -> [B * (K + 1), H] in the verify's row order (row r's K + 1
    positions together). The steps ran the same B rows, so the same kernels: either all of
    them left the residual apart or none did (residual None: an op set that adds it in the
    projections' epilogues, op_sets.FusedOps, already did)."""
    def rows(parts):
        return torch.stack(parts, dim=1).flatten(0, 1)

    residuals = [s.residual for s in states]
    return FinalHidden(rows([s.out for s in states]),
                       None if residuals[0] is None else rows(residuals))


def spec_iteration(target: LlamaModel, draft: DraftModel, state: DecodeState, kv: KVCache,
                   bucket: int, block_size: int, k: int, variant: Variant) -> None:
    rows = slice(0, bucket)
    pos0 = state.positions[rows]
    steps = state.steps[rows]
    temp, top_k, top_p = state.temperature[rows], state.top_k[rows], state.top_p[rows]
    seeds = state.seeds[rows]
    bt = state.block_tables[rows]

    # 1. draft: K tokens per row, each drawn from the draft's distribution q_j. Forward k + 1
    # runs d_K through the draft: its draft KV, and for a self-draft its layer-N state.
    # Every step's positions, cache slots and key counts in two launches: [K + 1, B], so step
    # j's are a contiguous row.
    offs = torch.arange(k + 1, device=state.device)
    draft_pos = offs[:, None] + pos0[None, :]
    slots, lens = (t.view(k + 1, bucket) for t in target.ops.decode_metadata(
        draft_pos.reshape(-1), bt.repeat(k + 1, 1), block_size))
    draft_steps = offs[:, None] + steps[None, :]  # [K + 1, B] output index of each draft
    tok = state.input_ids[rows]
    drafts, qs, states = [], [], []
    for j in range(k + 1):
        attn = AttentionInputs(slot_mapping=slots[j], block_tables=bt, seq_lens=lens[j],
                               rows_are_sequences=True)
        hidden = draft.model.forward(tok, draft_pos[j], attn, draft.kv)
        states.append(hidden)
        if j == k:
            break
        logits = _masked(draft.model, state, draft.model.compute_logits(hidden), bucket,
                         draft_steps[j])
        if variant.sampled:
            q = sampling_probs_ref(logits, temp, top_k, top_p, variant.filters)
            tok = draw_from_probs(q, seeds ^ SALT_DRAFT, draft_steps[j])
            qs.append(q)
        else:  # every row greedy: q would be one-hot on the argmax
            tok = draft.model.ops.argmax(logits)
        drafts.append(tok)
    draft_tokens = torch.stack(drafts, dim=1)  # [B, K]

    # 2. verify: the target over [input, d_1..d_K] at positions pos0..pos0+K
    pos = (pos0[:, None] + offs[None, :]).reshape(-1)
    verify_bt = repeat_rows(bt, k + 1)
    verify_slots, verify_lens = target.ops.decode_metadata(pos, verify_bt, block_size)
    attn = AttentionInputs(slot_mapping=verify_slots, block_tables=verify_bt,
                           seq_lens=verify_lens)
    if draft.shares_target_kv:
        hidden = target.forward_layers(_interleave(states), pos, attn, kv,
                                       first_layer=draft.model.config.num_layers)
    else:
        ids = torch.cat([state.input_ids[rows][:, None], draft_tokens], dim=1)
        hidden = target.forward(ids.reshape(-1), pos, attn, kv)
    raw = target.compute_logits(hidden)  # [B*(K+1), V]
    rep = lambda x: repeat_rows(x, k + 1)
    step_all = draft_steps.t().reshape(-1)  # row-major [B, K + 1]
    logits = target.ops.mask_stop_tokens(raw, rep(state.stop_ids[rows]), step_all,
                                         rep(state.min_tokens[rows]),
                                         inplace=not variant.logprobs)

    no_drafts = hold = live = None
    if variant.penalties:  # grammar rows come with it (the scheduler sets both)
        live = torch.arange(bucket, device=state.device) < state.num_rows
        if variant.grammar:
            hold = Hold(state, bucket)
            live = live & ~hold.held
        no_drafts = apply_controls(target, state, logits.view(bucket, k + 1, -1), drafts,
                                   rep(temp), live, variant.grammar)

    # 3. accept a prefix, add one corrected or bonus token
    # (greedy rows: the target's argmaxes, and the count follows from the drafts)
    if variant.sampled:
        p = sampling_probs_ref(logits, rep(temp), rep(top_k), rep(top_p), variant.filters)
        tokens, count = rejection_sample_ref(p.view(bucket, k + 1, -1), torch.stack(qs, dim=1),
                                             draft_tokens, seeds, steps, no_drafts)
    elif variant.penalties:  # the count is needed here, for the penalty counts
        tokens, count = accept_argmaxes(target.ops.argmax(logits).view(bucket, k + 1),
                                        draft_tokens, no_drafts)
    else:
        tokens, count = target.ops.argmax(logits).view(bucket, k + 1), None
    if variant.penalties:
        recount(target, state, draft_tokens, tokens, count, live)
    # 4. the step's output; live rows advance by the emitted count, and the last emitted
    # token is the next input
    target.ops.spec_advance(tokens, count, draft_tokens, state.input_ids[rows],
                            state.positions[rows], state.steps[rows], state.num_rows,
                            state.out_tokens[rows], state.out_count[rows])
    if hold is not None:
        hold.restore(state)
    if variant.logprobs:
        chosen, top_vals, top_ids = target.ops.logprobs(raw, tokens.reshape(-1),
                                                        state.out_top_ids.shape[-1])
        state.out_logprob[rows] = chosen.view(bucket, k + 1)
        state.out_top_logprobs[rows] = top_vals.view(bucket, k + 1, -1)
        state.out_top_ids[rows] = top_ids.view(bucket, k + 1, -1)
