"""kernels/gather_triton.py: a rank's LM head landing its logits in the peer's zone from its
epilogue, against the plain projection and torch.cat, with both ranks' zones in one device's
memory, one rank at a time (the peer's tiles staged by hand for the first). Two ranks at once
run in the two-GPU tests (tests/test_gpu_tensor_parallel.py)."""
import pytest
import torch

from graphexec.kernels import gather_triton as gt
from graphexec.kernels import linear_fused_triton as lf
from graphexec.kernels import linear_triton as lt
from kernel_helpers import CPU_MODE, DEV, RUNNABLE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not RUNNABLE, reason="needs Triton")]

BOX_BYTES = 1 << 16
DTYPES = [torch.float16] + ([] if CPU_MODE else [torch.bfloat16])


class Zones:
    """Two ranks' landing zones and arrival counters in this device's memory."""

    def __init__(self, world: int = 2):
        self.zones = [torch.zeros(world * BOX_BYTES, dtype=torch.uint8, device=DEV)
                      for _ in range(world)]
        self.counters = [torch.zeros(8, dtype=torch.int64, device=DEV) for _ in range(world)]
        self.waited = [torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(world)]
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64,
                                       device=DEV)
        self.landings = [gt.Landing(rank, world, ptrs(self.zones), ptrs(self.counters),
                                    self.zones[rank], self.waited[rank], BOX_BYTES)
                         for rank in range(world)]


CONFIG = lt.LinearConfig(16, 32, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(3, 96, 64), (17, 64, 32)])
def test_each_rank_gets_the_whole_logits_from_its_lm_head(dtype, rows, n, k):
    """Rank 0 runs with rank 1's tiles staged in its zone and its counter raised; then rank 1
    for real, on what rank 0's LM head landed. Both return torch.cat of the two slices, each
    slice the plain projection's bits; each rank's tiles sit in its box of the other's zone,
    each counter grew by the other's program count, and each rank's wait recorded it."""
    zones = Zones()
    g = torch.Generator().manual_seed(rows * n)
    xs = [(torch.randn(rows, k, generator=g) / 4).to(dtype).to(DEV) for _ in range(2)]
    ws = [(torch.randn(n, k, generator=g) / 8).to(dtype).to(DEV) for _ in range(2)]
    slices = [lt.linear(xs[r], ws[r], config=CONFIG) for r in range(2)]
    programs = -(-n // CONFIG.block_n) * -(-rows // CONFIG.block_m)
    zones.landings[0].box(1, rows, n, dtype).copy_(slices[1])
    zones.counters[0][0] = programs
    got0 = lf.linear_gathered(xs[0], ws[0], zones.landings[0], CONFIG)
    assert torch.equal(zones.landings[1].box(0, rows, n, dtype), slices[0])
    assert zones.counters[1][0].item() == programs and zones.waited[0].item() == programs
    got1 = lf.linear_gathered(xs[1], ws[1], zones.landings[1], CONFIG)
    want = gt.gather_ref(slices)
    assert torch.equal(got0, want) and torch.equal(got1, want)
    assert zones.waited[1].item() == programs
    # nothing in a rank's own box, nothing past the slice, the counters' neighbours untouched
    nbytes = rows * n * 2
    for rank in range(2):
        assert not zones.zones[rank][rank * BOX_BYTES:(rank + 1) * BOX_BYTES].any()
        other = 1 - rank
        assert not zones.zones[rank][other * BOX_BYTES + nbytes:(other + 1) * BOX_BYTES].any()
        assert not zones.counters[rank][1:].any()


def test_a_second_gather_waits_for_the_next_arrivals():
    """The counter only grows: a second gather's wait starts where the first ended, so the
    tiles of a replayed step are waited for again (rank 0, its peer's staged each time)."""
    zones = Zones()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 32, generator=g)).to(torch.float16).to(DEV)
    w = (torch.randn(64, 32, generator=g) / 8).to(torch.float16).to(DEV)
    programs = 2
    for step in (1, 2):
        peer = torch.full((4, 64), float(step), dtype=torch.float16, device=DEV)
        zones.landings[0].box(1, 4, 64, torch.float16).copy_(peer)
        zones.counters[0][0] = step * programs
        got = lf.linear_gathered(x, w, zones.landings[0], CONFIG)
        assert torch.equal(got[:, 64:], peer)
        assert zones.waited[0].item() == step * programs


def test_what_does_not_fit_a_box_is_left_to_the_caller():
    zones = Zones()
    landing = zones.landings[0]
    assert landing.fits(64, BOX_BYTES // 128, torch.bfloat16)
    assert not landing.fits(64, BOX_BYTES // 128 + 1, torch.bfloat16)
    assert not landing.fits(4, 64, torch.float32)
    x = torch.zeros(4, 32, dtype=torch.float16, device=DEV)
    assert lf.linear_gathered(x, torch.zeros(BOX_BYTES, 32, dtype=torch.float16, device=DEV),
                              landing, CONFIG) is None
    assert lf.linear_gathered(x, torch.zeros(64, 32, dtype=torch.float16, device=DEV), landing,
                              lt.LinearConfig(16, 32, 16, split_k=2)) is None
    assert not any(z.any() for z in zones.zones) and not any(c.any() for c in zones.counters)


def _wait_for_tiles_that_never_come(conn) -> None:
    from test_kernels_all_reduce import time_a_trap

    zones = Zones()
    full = torch.zeros(4, 128, dtype=torch.float16, device=DEV)
    zones.counters[0][0] = 2  # a first wait that passes: compiled before the clock starts
    gt.wait_and_place(zones.landings[0], full, 2, timeout_s=30)
    # the counter stays at 2: the next wait needs 4
    time_a_trap(conn, lambda: gt.wait_and_place(zones.landings[0], full, 2, timeout_s=0.2))


@pytest.mark.skipif(CPU_MODE, reason="the deadline reads the GPU's clock")
def test_tiles_that_never_come_fail_the_context_instead_of_hanging():
    """A wait whose peer never lands its tiles traps past its deadline: the host's next wait
    raises, no sooner than the deadline."""
    from test_kernels_all_reduce import assert_trapped_in_a_process

    assert_trapped_in_a_process(_wait_for_tiles_that_never_come, 0.2)


def test_three_ranks_land_in_each_peer_and_wait_for_both():
    """The last of three ranks, its two peers' slices staged and its counter raised by both
    peers' programs: it returns the three slices in rank order, its tiles land in box 2 of
    both peers' zones, and each peer's counter grew by its program count."""
    zones = Zones(3)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(5, 32, generator=g) / 4).to(torch.float16).to(DEV)
    w = (torch.randn(64, 32, generator=g) / 8).to(torch.float16).to(DEV)
    mine = lt.linear(x, w, config=CONFIG)
    peers = [torch.full((5, 64), float(q + 1), dtype=torch.float16, device=DEV) for q in (0, 1)]
    programs = -(-64 // CONFIG.block_n)
    for q in (0, 1):
        zones.landings[2].box(q, 5, 64, torch.float16).copy_(peers[q])
    zones.counters[2][0] = 2 * programs
    got = lf.linear_gathered(x, w, zones.landings[2], CONFIG)
    assert torch.equal(got, gt.gather_ref([*peers, mine]))
    assert zones.waited[2].item() == 2 * programs
    for q in (0, 1):
        assert torch.equal(zones.landings[q].box(2, 5, 64, torch.float16), mine)
        assert zones.counters[q][0].item() == programs
