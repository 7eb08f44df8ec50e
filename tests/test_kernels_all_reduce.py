"""kernels/all_reduce_triton.py against its reference (the rank-order fp32 sum, rounded once),
with the ranks' buffers in one device's memory: one rank at a time (its peer's half of the
exchange staged by hand), and on CUDA a rank whose peer never comes. Two ranks at once run in
the two-GPU tests (tests/test_gpu_tensor_parallel.py), over NVLink, eager and in graphs: on
one GPU, a rank's host launch can wait for the device (a module load, a cudaMalloc) while the
device waits for the other rank's launch, which a test cannot rule out."""
import pytest
import torch

from graphexec.kernels import all_reduce_triton as ar
from kernel_helpers import CPU_MODE, DEV, RUNNABLE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not RUNNABLE, reason="needs Triton")]

SLOT_BYTES = 64 * 1024
# The interpreter rounds fp32 to bf16 by truncation; its bf16 is not the GPU's.
DTYPES = [torch.float32, torch.float16] + ([] if CPU_MODE else [torch.bfloat16])


class Ranks:
    """world ranks' buffers (flag area, two slots) in this device's memory, and each rank's
    view of them."""

    def __init__(self, world: int):
        self.world = world
        self.buffers = [torch.zeros(ar.FLAG_BYTES + 2 * SLOT_BYTES, dtype=torch.uint8,
                                    device=DEV) for _ in range(world)]
        bases = [b.data_ptr() for b in self.buffers]
        self.data_ptrs = torch.tensor([b + ar.FLAG_BYTES for b in bases], dtype=torch.int64,
                                      device=DEV)
        self.flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=DEV)

    def peers(self, rank: int) -> ar.PeerBuffers:
        return ar.PeerBuffers(rank, self.world, self.data_ptrs, self.flag_ptrs, SLOT_BYTES)

    def flags(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][: ar.FLAG_BYTES].view(torch.int32)

    def slot(self, rank: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
        start = ar.FLAG_BYTES + slot * SLOT_BYTES
        return self.buffers[rank][start: start + SLOT_BYTES].view(dtype)


def _parts(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).to(DEV) for _ in range(world)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,slot", [(7, 0), (5000, 1), (4096, 0)])
def test_one_rank_at_a_time(dtype, n, slot):
    """Rank 0 runs with rank 1's half staged (its part in rank 1's slot, its flags raised in
    rank 0's area), then rank 1 runs for real against what rank 0 left. Both get the
    reference's bits; rank 0 raised exactly one flag per program in rank 1's area, rank 1 took
    them all, and rank 0 took the staged ones."""
    ranks = Ranks(2)
    x = _parts(2, n, dtype, seed=n + slot)
    programs = -(-n // ar.BLOCK)
    ranks.slot(1, slot, dtype)[:n] = x[1]
    ranks.flags(0)[1: 2 * programs: 2] = 1
    out0 = ar.one_shot_all_reduce(x[0], ranks.peers(0), slot, timeout_s=30)
    raised = ranks.flags(1)[: 2 * programs + 2].cpu()
    assert raised[0: 2 * programs: 2].tolist() == [1] * programs
    assert raised[1::2].tolist() == [0] * (programs + 1) and raised[2 * programs] == 0
    assert ranks.flags(0)[: 2 * programs].cpu().tolist() == [0] * (2 * programs)
    # rank 0's part is in its slot for rank 1 to read
    assert torch.equal(ranks.slot(0, slot, dtype)[:n], x[0])
    out1 = ar.one_shot_all_reduce(x[1], ranks.peers(1), slot, timeout_s=30)
    want = ar.all_reduce_ref(x)
    assert torch.equal(out0, want) and torch.equal(out1, want)
    assert ranks.flags(1)[: 2 * programs].cpu().tolist() == [0] * (2 * programs)
    # rank 1's own raises wait in rank 0's area (staged ones were taken: these are new)
    assert ranks.flags(0)[1: 2 * programs: 2].cpu().tolist() == [1] * programs


def test_a_message_too_large_or_a_bad_slot_is_refused():
    ranks = Ranks(2)
    big = torch.zeros(SLOT_BYTES // 4 + 1, dtype=torch.float32, device=DEV)
    assert not ar.fits(ranks.peers(0), big)
    assert not ar.fits(ranks.peers(0), big[:0])  # no flags would cross: the slots would skew
    with pytest.raises(ValueError, match="do not fit"):
        ar.one_shot_all_reduce(big, ranks.peers(0), 0)
    with pytest.raises(ValueError, match="slot=2"):
        ar.one_shot_all_reduce(big[:8], ranks.peers(0), 2)


def _wait_for_a_peer_that_never_comes(conn) -> None:
    ranks = Ranks(2)
    x = _parts(2, 4096, torch.bfloat16, seed=1)
    try:
        ar.one_shot_all_reduce(x[0], ranks.peers(0), 0, timeout_s=0.2)
        torch.cuda.synchronize()
        conn.send("no error")
    except RuntimeError as e:  # the trap: the context fails
        conn.send(f"error: {e}")


@pytest.mark.skipif(CPU_MODE, reason="the deadline reads the GPU's clock")
def test_a_peer_that_never_comes_fails_the_context_instead_of_hanging():
    """After its deadline the kernel traps: the CUDA context fails and the host's next wait
    raises, so a dead or hung peer can neither hang the device nor leave stale sums. (In a
    process of its own: the failed context cannot run anything after.)"""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_wait_for_a_peer_that_never_comes, args=(theirs,), daemon=True)
    p.start()
    theirs.close()
    try:
        assert ours.poll(120), "the kernel did not end"
        assert ours.recv().startswith("error: "), "the wait ended without failing the context"
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
