"""Which data-parallel replica takes a request: the routing policy, in one place.

By load: the live replica with the fewest requests running and waiting. By prefix (the default
with prefix caching on): the replica that already holds the longest run of the prompt's leading
KV blocks, so that a conversation's next turn finds its history cached, unless that replica is
busier than the least loaded one by more than `slack` requests (a popular system prompt must
not pile every request onto one replica).

What each replica holds is not asked of it: the router remembers the block keys it sent there
(the same keys prefix caching uses, block_pool.chain_hashes), as many as the replica has KV
blocks, least recently routed forgotten first. That mirrors the replica's own LRU of cached
blocks closely enough to route by, at no cost to the engines.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ..block_pool import chain_hashes

ROUTINGS = ("prefix", "load")


@dataclass
class Decision:
    replica: int
    hit_blocks: int  # leading blocks of the prompt the chosen replica is thought to hold
    by_prefix: bool  # chosen for its prefix rather than its load


@dataclass
class Router:
    num_replicas: int
    routing: str = "prefix"
    slack: int = 8
    # Both set from the engines' own once they are ready (Replicas.submit).
    block_size: int = 16
    capacity: int = 4096  # block keys remembered per replica: its KV blocks
    _held: list[OrderedDict] = field(default_factory=list)
    _turn: int = -1

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"data-parallel routing must be one of {ROUTINGS}, "
                             f"got {self.routing!r}")
        self._held = [OrderedDict() for _ in range(self.num_replicas)]

    def choose(self, prompt: list[int], loads: list[int], live: list[bool]) -> Decision:
        """loads: requests running and waiting per replica. At least one must be live."""
        candidates = [r for r in range(self.num_replicas) if live[r]]
        if not candidates:
            raise RuntimeError("no live replica to route to")
        # Ties go round the replicas, so that light traffic spreads too.
        self._turn = (self._turn + 1) % self.num_replicas
        least = min(candidates, key=lambda r: (loads[r], (r - self._turn) % self.num_replicas))
        if self.routing == "load":
            return Decision(least, 0, False)
        keys = chain_hashes(prompt, self.block_size, len(prompt) // self.block_size)
        hits = {r: self._hits(r, keys) for r in candidates}
        best = max(candidates, key=lambda r: (hits[r], -loads[r], -r))
        chosen = best if hits[best] and loads[best] <= loads[least] + self.slack else least
        self._remember(chosen, keys)
        return Decision(chosen, hits[chosen], chosen == best and hits[best] > 0)

    def _hits(self, replica: int, keys: list[bytes]) -> int:
        held = self._held[replica]
        n = 0
        for key in keys:  # chained keys: the first miss ends the shared prefix
            if key not in held:
                break
            n += 1
        return n

    def _remember(self, replica: int, keys: list[bytes]) -> None:
        held = self._held[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        """The replica died: what it held is gone."""
        self._held[replica].clear()
