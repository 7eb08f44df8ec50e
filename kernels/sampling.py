"""Sampling: temperature, top-k, top-p, greedy, logprobs; PyTorch reference.

Randomness is counter based: the noise for vocabulary entry i of a request's n-th token is a hash
of (seed, n, i). Nothing depends on the batch a row runs in or on a generator's state, so a seeded
request gives the same tokens alone or in any batch, in sync or async mode, on CPU or GPU.

A row samples by the Gumbel-max rule: argmax(logits / T + g) over the tokens that survive top-k
and top-p, with g = -log(-log(u)). That draws exactly from softmax(logits / T) restricted to the
kept set, and needs no sort and no cumulative sum, so the kernel can do it in one pass.
"""
from __future__ import annotations

import torch

from .row_vectors import check_dense

MASK32 = 0xFFFFFFFF
MAX_LOGPROBS = 20


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x * c mod 2**32 without ever overflowing int64 (halves of c keep each product < 2**48).
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Integer finaliser on uint32 values held in int64 (a well mixed bijection of 32 bits)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def row_key(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, step); seeds use up to 64 bits."""
    lo = seeds & MASK32
    hi = (seeds >> 32) & MASK32
    return hash32(lo ^ hash32(hi ^ hash32(steps & MASK32)))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (seed, step, index)."""
    key = row_key(seeds.long(), steps.long())[:, None]
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    bits = hash32(hash32(_mul32(idx, 0x9E3779B1) ^ key) + key)
    return ((bits >> 8).double() * 2.0**-24 + 2.0**-25).float()


def topk_topp_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V] of kept tokens. top_k <= 0 or >= V disables it; top_p >= 1 disables it.
    Top-k is applied first, top-p to the renormalised survivors. Ties at a cut are all kept."""
    b, v = scaled.shape
    sorted_vals, _ = scaled.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > v), torch.full_like(top_k, v), top_k).long()
    kth = sorted_vals.gather(1, (k - 1)[:, None])
    keep = scaled >= kth
    in_topk = torch.arange(v, device=scaled.device)[None, :] < k[:, None]
    probs = torch.softmax(sorted_vals.masked_fill(~in_topk, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each sorted entry
    # top_p >= 1 is off: an fp32 cumsum can reach 1.0 before the last entries and would cut them
    kept_sorted = ((before < top_p[:, None].float()) | (top_p[:, None] >= 1)) & in_topk
    # smallest kept value; ties with it survive too
    n_kept = kept_sorted.sum(-1).clamp(min=1)
    cutoff = sorted_vals.gather(1, (n_kept - 1)[:, None])
    return keep & (scaled >= cutoff)


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> tokens [B] (int64). temperature == 0 means greedy."""
    check_dense(temperature, top_k, top_p, seeds, steps)
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / t[:, None]
    keep = topk_topp_mask(scaled, top_k, top_p)
    u = uniform_noise(seeds, steps, logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    # A -inf logit (a masked token) stays out even where the noise is +inf: u rounds to 1.0 in
    # fp32 for one entry in 2**24, and -inf + inf would be a NaN that argmax picks.
    keep &= scaled > float("-inf")
    sampled = (scaled + gumbel).masked_fill(~keep, float("-inf")).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), sampled)


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> int64 [N]: the first index of each row's maximum (greedy choice)."""
    return logits.argmax(-1)


def mask_stop_tokens_ref(logits: torch.Tensor, stop_ids: torch.Tensor, steps: torch.Tensor,
                         min_tokens: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """min_tokens: rows whose step is below their min_tokens may not emit any id of
    stop_ids[row] (padded with -1). Touches only the [B, 16] stop entries (no full-vocabulary
    pass); `inplace` writes into `logits` itself, for callers that no longer need the unmasked
    values."""
    out = logits if inplace else logits.clone()
    ids = stop_ids.clamp(min=0)
    hit = (stop_ids >= 0) & (steps < min_tokens)[:, None]
    # amin with +inf leaves an entry as it is, with -inf masks it; duplicate ids (a padding -1
    # clamped onto a real stop id 0) then agree whatever order the writes land in.
    fill = torch.where(hit, float("-inf"), float("inf")).to(out.dtype)
    return out.scatter_reduce_(1, ids, fill, reduce="amin")


def logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor,
                 n: int = MAX_LOGPROBS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution (before temperature and masking):
    (chosen [B], top values [B, n], top ids [B, n])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.long()[:, None]).squeeze(1)
    top_vals, top_ids = lp.topk(n, dim=-1)
    return chosen, top_vals, top_ids
