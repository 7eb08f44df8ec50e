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
