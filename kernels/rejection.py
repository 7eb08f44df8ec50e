"""Speculative decoding: target and draft distributions, and the rejection sampler (PyTorch
reference; graph safe, no host syncs).

Greedy rows are the same rule with one-hot distributions: a draft token is accepted exactly when
it equals the target's argmax, and the residual is the target's argmax. So one code path serves
greedy and sampled rows, and for sampled rows it is the standard lossless rule: accept draft
token d with probability min(1, p(d) / q(d)), else draw from normalise(max(0, p - q)).

A row may take no drafts (`no_drafts`: a grammar row, whose masks the host knows only for the
step's first position): its first draft is rejected whatever it is and the token is drawn from
p itself, as the plain sampler would draw it.
"""
from __future__ import annotations

import torch

from .sampling import topk_topp_mask, uniform_noise

# Independent random streams per purpose, all keyed by (seed ^ salt, output index).
SALT_DRAFT = 0x5D5D_0001
SALT_ACCEPT = 0x5D5D_0002
SALT_RESIDUAL = 0x5D5D_0003


def sampling_probs_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, filters: bool = True) -> torch.Tensor:
    """[N, V] -> the distribution the plain sampler draws from: softmax(logits / T) over the
    tokens top-k and top-p keep, or one-hot on the argmax where temperature == 0. filters=False
    promises that no row uses top-k or top-p."""
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / t[:, None]
    if filters:  # the sort behind top-k / top-p only when some row uses them
        scaled = scaled.masked_fill(~topk_topp_mask(scaled, top_k, top_p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def draw_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One draw per row from (unnormalised) probabilities, by Gumbel-max on log(probs)."""
    u = uniform_noise(seeds, steps, probs.shape[1])
    score = torch.log(probs) - torch.log(-torch.log(u))
    # A token of probability 0 (masked, filtered) stays out even where the noise is +inf: u
    # rounds to 1.0 in fp32 for one entry in 2**24, and -inf + inf is a NaN that argmax picks.
    return score.masked_fill(probs <= 0, float("-inf")).argmax(-1)


def rejection_sample_ref(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                         seeds: torch.Tensor, steps: torch.Tensor,
                         no_drafts: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """p: [B, K+1, V] target distributions at the K+1 verified positions; q: [B, K, V] the
    draft distributions the K draft tokens `draft` [B, K] were drawn from; steps: [B] index of
    the first output token; no_drafts: [B] bool, rows that emit one token drawn from p[:, 0]
    (None: none). Returns (tokens [B, K+1], count [B]): the first count tokens of each row are
    emitted (the accepted drafts, then one corrected or bonus token)."""
    b, k1, v = p.shape
    k = k1 - 1
    j = torch.arange(k, device=p.device)
    step_j = steps[:, None] + j[None, :]  # output index each draft token would take
    p_d = p[:, :k].gather(2, draft[..., None]).squeeze(-1)
    q_d = q.gather(2, draft[..., None]).squeeze(-1)
    u = torch.stack([uniform_noise(seeds ^ SALT_ACCEPT, step_j[:, i], 1)[:, 0]
                     for i in range(k)], dim=1) if k else p_d
    accept = u * q_d <= p_d
    if no_drafts is not None:
        accept &= ~no_drafts[:, None]
    # accepted prefix length: number of leading True
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1)  # [B]
    # the token after the accepted prefix: residual draw at a rejection, bonus draw otherwise
    idx = n_acc.clamp(max=k)
    p_at = p.gather(1, idx[:, None, None].expand(b, 1, v)).squeeze(1)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # no draft after the last one
    q_at = q_pad.gather(1, idx[:, None, None].expand(b, 1, v)).squeeze(1)
    if no_drafts is not None:  # no draft to correct for: the residual is p itself
        q_at = q_at.masked_fill(no_drafts[:, None], 0.0)
    residual = (p_at - q_at).clamp(min=0)
    all_accepted = n_acc == k
    # Where p == q exactly the residual is empty; the rule is then never reached (the draft is
    # always accepted), but keep the draw well defined.
    residual = torch.where((residual.sum(-1, keepdim=True) > 0) & ~all_accepted[:, None],
                           residual, p_at)
    last_step = steps + n_acc
    salt = torch.where(all_accepted, seeds, seeds ^ SALT_RESIDUAL)
    extra = draw_from_probs(residual, salt, last_step)
    tokens = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    tokens = tokens.scatter(1, idx[:, None], extra[:, None])
    return tokens, n_acc + 1


def greedy_accept(logits: torch.Tensor, draft: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """rejection_sample_ref for a batch of greedy rows, without the distributions: logits
    [B, K+1, V] of the target at the K+1 verified positions, draft [B, K]. A draft token is
    accepted while it equals the target's argmax, and the token after the accepted prefix is the
    target's argmax there, so the emitted tokens are the target's argmaxes themselves. Returns
    (tokens [B, K+1], count [B]) like rejection_sample_ref."""
    return accept_argmaxes(logits.argmax(-1), draft)


def accept_argmaxes(target: torch.Tensor, draft: torch.Tensor,
                    no_drafts: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_accept from the target's argmaxes [B, K+1] (computed by whichever kernel).
    no_drafts: [B] bool, rows whose drafts are all rejected (count 1), or None."""
    accept = draft == target[:, :-1]
    if no_drafts is not None:
        accept &= ~no_drafts[:, None]
    return target, torch.cumprod(accept.long(), dim=1).sum(1) + 1
