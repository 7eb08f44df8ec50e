"""Which projection weight the decode forward reads after which: the model links its weights in
launch order once (qkv, o, gate_up, down of each layer, then the LM head) through its op set
(Ops.link_weights), and an op set that warms L2 with the next projection's weight
(kernels/l2_prefetch.py) asks its WeightOrder for it. The order belongs to the op set the
engine made, so it lives and dies with that engine's model. Weights never linked have no next
weight, and nothing is prefetched."""
from __future__ import annotations

import torch


class WeightOrder:
    def __init__(self) -> None:
        # id(weight) -> (weight, the weight after it); holding the weight keeps its id unique
        self._next: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def link(self, weights: list[torch.Tensor]) -> None:
        """weights: the projections in the order one decode forward launches them. A weight
        already linked keeps its link: the target model links first, and a self-draft built on
        its first layers (graphexec/spec.py) would otherwise point the target's last draft
        layer at the LM head (a speed question only: the link never changes a result)."""
        for weight, following in zip(weights, weights[1:]):
            self._next.setdefault(id(weight), (weight, following))

    def next(self, weight: torch.Tensor) -> torch.Tensor | None:
        entry = self._next.get(id(weight))
        return None if entry is None else entry[1]
