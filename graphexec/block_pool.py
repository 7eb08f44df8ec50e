"""KV cache blocks: who may use which block, with reference counts, and (prefix caching) which
full blocks hold the KV of a known token chain."""
from __future__ import annotations

import array
import hashlib
from collections import OrderedDict


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The keys of the first `num_blocks` full blocks of `token_ids`: each a hash of its tokens
    chained with the key of the block before, so a key names the whole prefix up to its block's
    end. sha256, not Python's hash: a collision would hand a request another prompt's KV.
    The tokens become bytes once and each block hashes a slice of them (a third less host time
    than converting block by block, on every admission with caching on)."""
    step = block_size * 8
    data = array.array("q", token_ids[:num_blocks * block_size]).tobytes()
    keys, prev, sha256 = [], b"", hashlib.sha256
    for off in range(0, num_blocks * step, step):
        prev = sha256(prev + data[off:off + step]).digest()
        keys.append(prev)
    return keys


class BlockPool:
    """Hands out block ids 0..num_blocks-1. A block is free when its reference count is 0.
    Invariant: num_free + num_used == num_blocks, always.

    With caching, a full block whose KV is written can be registered under its chain key. When
    its last owner frees it, it keeps its key and stays in the free list, where a new request
    that starts with the same tokens can take it back (`take`); it loses the key only when an
    allocation reuses it for other tokens. The free list is least recently freed first, so the
    cached blocks evicted first are those unused longest."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refcount = [0] * num_blocks
        # A freed block goes to the back, so it is handed out again as late as possible.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evicted = 0  # cached blocks reused for other tokens

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix, in use or free."""
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free")
        out = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
            key = self._key_of.pop(b, None)
            if key is not None:  # its tokens are about to be overwritten
                del self._block_of[key]
                self.evicted += 1
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
                self._free[b] = None

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcount[block]

    # -- prefix caching -------------------------------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The block registered under `key`, in use or free; None if there is none."""
        return self._block_of.get(key)

    def take(self, block: int) -> None:
        """One more reference to a registered block, taking it out of the free list if no one
        held it. The caller has checked it against the key it wants."""
        self._check(block)
        if self._refcount[block] == 0:
            del self._free[block]
        self._refcount[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """Records that `block` holds the prefix `key` names (its KV written or launched). A
        block computed twice for one prefix (two requests prefilling it at once) keeps the
        first registration; the other copy stays private to its request."""
        self._check(block)
        if not self.enable_caching or key in self._block_of or block in self._key_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def _check(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} does not belong to this pool "
                             f"(0..{self.num_blocks - 1})")
