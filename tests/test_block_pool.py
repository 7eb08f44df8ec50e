import pytest
from hypothesis import given, settings, strategies as st

from graphexec.block_pool import BlockPool


def test_double_free_and_foreign_ids_raise():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free([blocks[0]])
    with pytest.raises(ValueError, match="does not belong"):
        pool.free([4])
    with pytest.raises(ValueError, match="does not belong"):
        pool.ref(-1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "ref"]), st.integers(0, 6)),
                max_size=60))
def test_random_sequences_keep_invariants(program):
    pool = BlockPool(16)
    owned: list[int] = []  # one entry per reference held
    for op, n in program:
        if op == "alloc":
            if pool.can_allocate(n):
                got = pool.allocate(n)
                assert len(set(got)) == n and not set(got) & set(owned)
                owned += got
            else:
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
        elif op == "free" and owned:
            b = owned.pop(n % len(owned))
            pool.free([b])
        elif op == "ref" and owned:
            b = owned[n % len(owned)]
            pool.ref(b)
            owned.append(b)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert pool.num_used == len(set(owned))
        for b in set(owned):
            assert pool.refcount(b) == owned.count(b)
    pool.free(owned)
    assert pool.num_free == pool.num_blocks


def test_chain_keys_name_the_whole_prefix():
    from graphexec.block_pool import chain_hashes

    a = chain_hashes(list(range(40)), 16, 2)
    b = chain_hashes(list(range(40)) + [7], 16, 2)
    c = chain_hashes([99] + list(range(1, 40)), 16, 2)
    assert a == b  # tokens past the full blocks do not count
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 changes every later key
    assert chain_hashes(list(range(16, 32)), 16, 1)[0] != a[1]  # same tokens, other prefix
    # the definition: sha256 of the previous key and the block's tokens as int64 bytes
    import hashlib
    import struct

    k0 = hashlib.sha256(struct.pack("<16q", *range(16))).digest()
    assert a == [k0, hashlib.sha256(k0 + struct.pack("<16q", *range(16, 32))).digest()]


def test_cached_block_survives_free_and_is_evicted_last_used_last():
    pool = BlockPool(4, enable_caching=True)
    x, y = pool.allocate(2)
    pool.register(x, b"kx")
    pool.register(y, b"ky")
    pool.free([x])
    pool.free([y])
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.lookup(b"kx") == x
    pool.take(x)  # a hit on a free cached block: it leaves the free list
    assert pool.refcount(x) == 1 and pool.num_free == 3
    got = pool.allocate(2)  # the never-cached blocks go first
    assert x not in got and y not in got and pool.num_cached == 2
    assert pool.allocate(1) == [y]  # then the cached one: its key is gone
    assert pool.lookup(b"ky") is None and pool.num_cached == 1 and pool.evicted == 1
    pool.take(x)
    assert pool.refcount(x) == 2  # shared by two owners


def test_register_keeps_the_first_block_of_a_key_and_needs_caching_on():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, b"k")
    pool.register(b, b"k")
    assert pool.lookup(b"k") == a and pool.key_of(b) is None
    off = BlockPool(4)
    c = off.allocate(1)[0]
    off.register(c, b"k")
    assert off.lookup(b"k") is None and off.num_cached == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "register", "hit"]),
                          st.integers(0, 6)), max_size=80))
def test_random_cached_sequences_keep_invariants(program):
    """A registered key always names a block holding it; a block is never both free and
    referenced; refcounts equal the references held."""
    pool = BlockPool(12, enable_caching=True)
    owned: list[int] = []
    keys: dict[bytes, int] = {}
    for op, n in program:
        if op == "alloc" and pool.can_allocate(n):
            got = pool.allocate(n)
            assert not set(got) & set(owned)
            for k in [k for k, b in keys.items() if b in got]:
                del keys[k]  # reused for other tokens
            owned += got
        elif op == "free" and owned:
            pool.free([owned.pop(n % len(owned))])
        elif op == "register" and owned:
            b, key = owned[n % len(owned)], bytes([n, len(owned)])
            if key not in keys and b not in keys.values():
                keys[key] = b
            pool.register(b, key)
        elif op == "hit" and keys:
            key = sorted(keys)[n % len(keys)]
            assert pool.lookup(key) == keys[key]
            pool.take(keys[key])
            owned.append(keys[key])
        free = set(pool._free)
        assert not free & set(owned)
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert pool.num_used == len(set(owned))
        for b in set(owned):
            assert pool.refcount(b) == owned.count(b)
        assert {k: pool.lookup(k) for k in keys} == keys
    pool.free(owned)
    assert pool.num_free == pool.num_blocks
