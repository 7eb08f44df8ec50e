"""KV cache blocks: who may use which block, with reference counts."""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids 0..num_blocks-1. A block is free when its reference count is 0.
    Invariant: num_free + num_used == num_blocks, always."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # FIFO: a freed block goes to the back, so it is handed out again as late as possible.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def ref(self, block: int) -> None:
        """Share a block already in use (prefix sharing, forks)."""
        self._check(block)
        if self._refcount[block] == 0:
            raise ValueError(f"block {block} is free; only a used block can be shared")
        self._refcount[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block returns to the pool at zero."""
        for b in blocks:
            self._check(b)
            if self._refcount[b] == 0:
                raise ValueError(f"double free of block {b}")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcount[block]

    def _check(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} does not belong to this pool "
                             f"(0..{self.num_blocks - 1})")
