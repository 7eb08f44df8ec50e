"""Rotary position embedding (neox layout: the two halves of each head rotate together)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    out = torch.where(wavelen < high_wavelen, inv_freq, out)
    return out.float()


def rope_cos_sin(max_positions: int, head_dim: int, theta: float, scaling=None,
                 device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables of shape [max_positions, head_dim // 2]."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], positions: [T]. Rotation is done in fp32."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c = cos[positions].unsqueeze(1)
        s = sin[positions].unsqueeze(1)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotates q and k, writes the rotated k and v to their cache slots; returns the rotated q."""
    from .attention import write_kv_ref

    q, k = apply_rope_ref(q, k, positions, cos, sin)
    write_kv_ref(k_cache, v_cache, k, v, slot_mapping)
    return q
