"""Which projection weight the decode forward reads after which: the model links its weights in
launch order once (qkv, o, gate_up, down of each layer, then the LM head), and an op set that
warms L2 with the next projection's weight (kernels/l2_prefetch.py) asks for it. The link is an
attribute of the weight tensor itself, so it lives and dies with the model's weights and no
table outlives them. Weights never linked have no next weight, and nothing is prefetched."""
from __future__ import annotations

import torch

_NEXT = "_graphexec_next_weight"


def link_next_weights(weights: list[torch.Tensor]) -> None:
    """weights: the projections in the order one decode forward launches them. A weight
    already linked keeps its link: the target model links first, and a self-draft built on
    its first layers (graphexec/spec.py) would otherwise point the target's last draft layer
    at the LM head (a speed question only: the link never changes a result)."""
    for weight, following in zip(weights, weights[1:]):
        if next_weight(weight) is None:
            setattr(weight, _NEXT, following)


def next_weight(weight: torch.Tensor) -> torch.Tensor | None:
    return getattr(weight, _NEXT, None)
