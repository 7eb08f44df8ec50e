"""Penalties, logit bias and min_p, and the token counts they read: PyTorch references.

Each row that uses any of them holds a penalty slot (capture/penalties.py); slot 0 is nobody's
and every op leaves its rows as they are. Per slot: the counts of the tokens generated so far
(int32 [S, V]), a byte of flags per token (uint8 [S, V]: IN_PROMPT, LISTED), the list of the
distinct tokens the slot has seen, prompt and generated (int32 [S, V], the first num_seen[slot]
entries), up to 300 (token id, bias) pairs (-1 pads), and the presence, frequency and repetition
penalties and log(min_p). Only listed tokens can be penalised, so the Triton kernel visits the
list instead of the vocabulary; apply_penalties_ref reads the dense counts and flags alone and
is its oracle. A token stays listed when a speculative step takes its count back to 0: with
count 0 and outside the prompt it is left as it is, as an unlisted one.

The order is vLLM's: logit bias, then the repetition penalty (over prompt and generated tokens,
as transformers: a positive logit divided by it, a negative one multiplied), then OpenAI's
frequency and presence penalties over the generated tokens
(logit - count * frequency - (count > 0) * presence); min_p after temperature, before top-k and
top-p. Everything runs on the logits in place, in their dtype, so the sampler and its Triton
kernel read them as they read plain logits; logprobs stay those of the raw distribution.
"""
from __future__ import annotations

import torch

from .row_vectors import check_dense

IN_PROMPT = 1  # flags: the token is in the prompt
LISTED = 2  # flags: the token is in the slot's list of seen tokens


def apply_logit_bias_ref(logits: torch.Tensor, slots: torch.Tensor, bias_ids: torch.Tensor,
                         bias_vals: torch.Tensor) -> torch.Tensor:
    """logits [B, V] += each row's slot's (id, bias) pairs, in place. bias_ids [S, N] (-1 pads,
    no id twice in a slot), bias_vals [S, N] fp32."""
    check_dense(slots)
    ids = bias_ids[slots]
    on = (ids >= 0) & (slots > 0)[:, None]
    # a pad (id -1) adds 0.0 to token 0, which leaves it as it is
    x = logits.float().scatter_add_(1, ids.clamp(min=0).long(),
                                    torch.where(on, bias_vals[slots], 0.0))
    logits.copy_(x)
    return logits


def apply_penalties_ref(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                        flags: torch.Tensor, seen_ids: torch.Tensor, num_seen: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor,
                        repetition: torch.Tensor) -> torch.Tensor:
    """The repetition, frequency and presence penalties, in place on logits [B, V] for rows
    whose slot is > 0. counts [S, V] int32, flags [S, V] uint8; the penalties [S] fp32.
    A dense pass: seen_ids and num_seen (the list the Triton kernel visits) are not read."""
    check_dense(slots)
    on = (slots > 0)[:, None]
    x = logits.float()
    cnt = counts[slots].float()
    seen = ((flags[slots] & IN_PROMPT) != 0) | (cnt > 0)
    rep = repetition[slots][:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    # frequency and presence only where counted: elsewhere x - 0 * frequency could turn a -0.0
    # into 0.0, which the kernel, visiting listed tokens only, never does
    f = frequency[slots][:, None] * cnt
    x = torch.where(cnt > 0, x - f - presence[slots][:, None], x)
    logits.copy_(torch.where(on, x.to(logits.dtype), logits))
    return logits


def apply_min_p_ref(logits: torch.Tensor, slots: torch.Tensor, temperature: torch.Tensor,
                    log_min_p: torch.Tensor) -> torch.Tensor:
    """In place: a sampled row (temperature > 0, slot > 0) drops to -inf every token whose
    logit / T is below its largest by more than -log(min_p), i.e. whose probability is below
    min_p times the largest. log_min_p [S] fp32 (-inf: off). Greedy rows are left as they are:
    min_p never removes the argmax."""
    check_dense(slots, temperature)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    scaled = logits.float() / t[:, None]
    floor = scaled.max(-1, keepdim=True).values + log_min_p[slots][:, None]
    on = ((slots > 0) & (temperature > 0))[:, None]
    return logits.masked_fill_(on & (scaled < floor), float("-inf"))


def count_tokens_ref(counts: torch.Tensor, flags: torch.Tensor, seen_ids: torch.Tensor,
                     num_seen: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                     live: torch.Tensor) -> None:
    """counts[slot, token] += 1 for each row whose slot is > 0 and that is live (a bool [B]:
    the rows that really sampled this step), and a token not listed yet is appended to the
    slot's list (seen_ids, num_seen) and flagged LISTED. No two rows share a slot above 0, so
    each slot takes at most one token a call. No host sync: it runs in captured steps."""
    check_dense(slots, tokens, live)
    on = live & (slots > 0)
    tok = tokens.long()
    counts.index_put_((slots, tok), on.to(counts.dtype), accumulate=True)
    old = flags[slots, tok]
    new = on & ((old & LISTED) == 0)
    # rows that append nothing write back what is there (a full list's end is clamped to the
    # last entry: a slot that has listed every token appends nothing)
    end = num_seen[slots].long().clamp(max=seen_ids.shape[1] - 1)
    seen_ids[slots, end] = torch.where(new, tok, seen_ids[slots, end]).to(seen_ids.dtype)
    flags[slots, tok] = torch.where(new, old | LISTED, old)
    num_seen.index_put_((slots,), new.to(num_seen.dtype), accumulate=True)
