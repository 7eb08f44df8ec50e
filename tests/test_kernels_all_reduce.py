"""kernels/all_reduce_triton.py against its reference (the rank-order fp32 sum, rounded once),
with the ranks' areas in one device's memory, one rank at a time: its peer's pushed words staged
by hand. Two ranks at once run in the two-GPU tests (tests/test_gpu_tensor_parallel.py), over
NVLink, eager and in graphs: on one GPU, a rank's host launch can wait for the device (a module
load, a cudaMalloc) while the device waits for the other rank's launch, which a test cannot rule
out."""
import pytest
import torch

from graphexec.kernels import Pushed
from graphexec.kernels import all_reduce_triton as ar
from graphexec.kernels import linear_fused_triton as lf
from graphexec.kernels import linear_triton as lt
from kernel_helpers import CPU_MODE, DEV, RUNNABLE
from tp_helpers import _reap, _spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not RUNNABLE, reason="needs Triton")]

MAX_WORDS = 8192
# The interpreter rounds fp32 to bf16 by truncation; its bf16 is not the GPU's.
DTYPES = [torch.float32, torch.float16] + ([] if CPU_MODE else [torch.bfloat16])


class Areas:
    """world ranks' LL areas in this device's memory, and each rank's view of them."""

    def __init__(self, world: int):
        self.world = world
        self.areas = [torch.zeros(ar.PeerAreas.area_bytes(world, MAX_WORDS) // 8,
                                  dtype=torch.int64, device=DEV) for _ in range(world)]
        self.ptrs = torch.tensor([a.data_ptr() for a in self.areas], dtype=torch.int64,
                                 device=DEV)

    def buffers(self, rank: int) -> ar.PeerAreas:
        return ar.PeerAreas(rank, self.world, self.ptrs, MAX_WORDS)

    def box(self, rank: int, slot: int, source: int) -> torch.Tensor:
        """The words rank `source` pushes into rank `rank`'s area for `slot`."""
        start = (slot * self.world + source) * MAX_WORDS
        return self.areas[rank][start: start + MAX_WORDS]


def _words(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as int32 words, each widened to int64 as the kernel packs it (flag 0)."""
    return x.view(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _parts(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).to(DEV) for _ in range(world)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,slot", [(2, 0), (5000, 1), (4096, 0)])
def test_one_rank_at_a_time(dtype, n, slot):
    """Rank 0 runs with rank 1's words staged in its area, then rank 1 runs for real on the
    words rank 0 pushed. Both get the reference's bits; each pushed exactly its message with
    the flag up into the other's box of this slot, touched nothing of the other slot, and left
    its own box zeroed (not arrived) for the slot's next use."""
    areas = Areas(2)
    x = _parts(2, n, dtype, seed=n + slot)
    words = x[0].numel() * x[0].element_size() // 4
    areas.box(0, slot, 1)[:words] = _words(x[1]) | ar.ARRIVED
    out0 = ar.all_reduce(x[0], areas.buffers(0), slot, timeout_s=30)
    pushed = areas.box(1, slot, 0)
    assert torch.equal(pushed[:words], _words(x[0]) | ar.ARRIVED)
    assert not pushed[words:].any() and not areas.box(0, slot, 1).any()
    out1 = ar.all_reduce(x[1], areas.buffers(1), slot, timeout_s=30)
    want = ar.all_reduce_ref(x)
    assert torch.equal(out0, want) and torch.equal(out1, want)
    assert not areas.box(1, slot, 0).any()
    assert torch.equal(areas.box(0, slot, 1)[:words], _words(x[1]) | ar.ARRIVED)
    for rank in range(2):  # a rank's own box of its own area is never written
        for s in range(2):
            assert not areas.box(rank, s, rank).any()
        assert not areas.box(rank, 1 - slot, 1 - rank).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d,slot", [(1, 64, 0), (3, 96, 1), (2, 4096, 0)])
def test_the_fused_add_and_norm_one_rank_at_a_time(dtype, rows, d, slot):
    """all_reduce_add_rms_norm as test_one_rank_at_a_time runs the plain kernel: both ranks
    get the residual sum bit for bit, and the normed rows within one rounding of the
    reference in 16 bits (the kernel sums the squares in another order), a few in fp32; the
    exchange leaves the boxes as the plain kernel does."""
    areas = Areas(2)
    x = [p.view(rows, d) for p in _parts(2, rows * d, dtype, seed=rows + d)]
    g = torch.Generator().manual_seed(d)
    residual = (torch.randn(rows, d, generator=g) * 4).to(dtype).to(DEV)
    weight = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV)
    words = rows * d * x[0].element_size() // 4
    areas.box(0, slot, 1)[:words] = _words(x[1]) | ar.ARRIVED
    normed0, summed0 = ar.all_reduce_add_rms_norm(x[0], residual, weight, 1e-5,
                                                  areas.buffers(0), slot, timeout_s=30)
    pushed = areas.box(1, slot, 0)
    assert torch.equal(pushed[:words], _words(x[0]) | ar.ARRIVED)
    assert not pushed[words:].any()  # nothing past the last row
    assert not areas.box(0, slot, 1).any()  # read and zeroed by rank 0
    normed1, summed1 = ar.all_reduce_add_rms_norm(x[1], residual, weight, 1e-5,
                                                  areas.buffers(1), slot, timeout_s=30)
    want_normed, want_summed = ar.all_reduce_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed0, want_summed) and torch.equal(summed1, want_summed)
    assert torch.equal(normed0, normed1)  # every rank the same bits
    # fp32: the reference's rsqrt and mean round apart from the kernel's 1 / sqrt_rn(sum / d)
    rounding = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
    ulp = rounding * want_normed.float().abs().clamp_min(1e-3)
    assert ((normed0.float() - want_normed.float()).abs() <= ulp).all()
    assert not areas.box(1, slot, 0).any()  # read and zeroed by rank 1
    assert torch.equal(areas.box(0, slot, 1)[:words], _words(x[1]) | ar.ARRIVED)
    for rank in range(2):  # a rank's own box is never written, nor the other slot
        for s in range(2):
            assert not areas.box(rank, s, rank).any()
        assert not areas.box(rank, 1 - slot, 1 - rank).any()


def test_the_fused_norm_refuses_what_it_cannot_take():
    areas = Areas(2)
    x = torch.zeros(2, 64, dtype=torch.float16, device=DEV)
    w = torch.ones(64, dtype=torch.float16, device=DEV)
    assert ar.fits_norm(areas.buffers(0), x, x, w)
    assert not ar.fits_norm(areas.buffers(0), x, x, w.float())  # weight of another dtype
    assert not ar.fits_norm(areas.buffers(0), x, x[:1], w)  # residual of another shape
    six = torch.zeros(2, 3, dtype=torch.float16, device=DEV)  # 12 bytes, rows of 6
    assert ar.fits(areas.buffers(0), six)
    assert not ar.fits_norm(areas.buffers(0), six, six, w[:3])
    wide = torch.zeros(1, 2 * ar.MAX_ROW_WORDS + 2, dtype=torch.float16, device=DEV)
    assert not ar.fits_norm(areas.buffers(0), wide, wide, wide[0])
    with pytest.raises(ValueError, match="not a message the kernel takes"):
        ar.all_reduce_add_rms_norm(x, x[:1], w, 1e-5, areas.buffers(0), 0)
    with pytest.raises(ValueError, match="slot=3"):
        ar.all_reduce_add_rms_norm(x, x, w, 1e-5, areas.buffers(0), 3)


def test_a_message_of_the_wrong_shape_or_a_bad_slot_is_refused():
    areas = Areas(2)
    big = torch.zeros(MAX_WORDS + 1, dtype=torch.float32, device=DEV)
    odd = torch.zeros(3, dtype=torch.float16, device=DEV)  # 6 bytes: not whole words
    assert not ar.fits(areas.buffers(0), big)
    assert not ar.fits(areas.buffers(0), odd)
    assert not ar.fits(areas.buffers(0), big[:0])  # no words would cross: the slots would skew
    assert not ar.fits(areas.buffers(0), big[:8].to(torch.int32))
    with pytest.raises(ValueError, match="do not fit"):
        ar.all_reduce(big, areas.buffers(0), 0)
    with pytest.raises(ValueError, match="slot=2"):
        ar.all_reduce(big[:8], areas.buffers(0), 2)


def test_three_ranks_sum_in_rank_order_and_keep_a_negative_zero():
    """The last of three ranks, its two peers' words staged: the fp32 sum runs in rank order
    (fp32 parts, where the order changes the rounding), its pushes land in box 2 of both
    peers' areas, and a sum of negative zeros stays negative, as NCCL's does."""
    areas = Areas(3)
    x = _parts(3, 3000, torch.float32, seed=7)
    x[0][:5] = -0.0
    x[1][:5] = -0.0
    x[2][:5] = -0.0
    x[0][5:] *= 1e4  # large and small magnitudes: a reordered sum would round differently
    words = x[0].numel()
    for q in (0, 1):
        areas.box(2, 1, q)[:words] = _words(x[q]) | ar.ARRIVED
    out = ar.all_reduce(x[2], areas.buffers(2), 1, timeout_s=30)
    want = ar.all_reduce_ref(x)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert torch.signbit(out[:5].cpu()).all()
    for q in (0, 1):
        assert torch.equal(areas.box(q, 1, 2)[:words], _words(x[2]) | ar.ARRIVED)
        assert not areas.box(2, 1, q).any()
    reordered = (x[2].double() + x[1].double()).float() + x[0]
    assert not torch.equal(out, reordered), "the test cannot tell the orders apart"


def _in_a_process(target) -> str:
    """target(conn) in a spawned process of its own (a kernel that traps fails its CUDA
    context, which cannot run anything after): the message it sends."""
    p, conn = _spawn(target, (), daemon=True)
    try:
        assert conn.poll(120), "the kernel did not end"
        return conn.recv()
    finally:
        _reap([p], 10)


def time_a_trap(conn, late) -> None:
    """Calls late() (launches a wait bound to time out, its kernel compiled already) and sends
    conn how long the host took to see the error, or "no error"."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        late()
        torch.cuda.synchronize()
        conn.send("no error")
    except RuntimeError as e:  # the trap: the context fails
        conn.send(f"error after {time.perf_counter() - start:.3f} s: {e}")


def assert_trapped_in_a_process(target, deadline_s: float) -> None:
    """target (which ends in time_a_trap) raised on the host, no sooner than deadline_s."""
    said = _in_a_process(target)
    assert said.startswith("error after "), said
    assert float(said.split()[2]) >= deadline_s, said


def _wait_for_a_late_peer(conn) -> None:
    areas = Areas(2)
    x = _parts(2, 4096, torch.bfloat16, seed=3)
    staged = _words(x[1]) | ar.ARRIVED
    box = areas.box(0, 0, 1)[: staged.numel()]
    side = torch.cuda.Stream()
    # every kernel the side stream runs is loaded before the kernel starts to spin: a module
    # loaded lazily while it spins could wait for it
    torch.cuda._sleep(1)
    torch.empty_like(staged).copy_(staged)
    torch.cuda.synchronize()
    out = ar.all_reduce(x[0], areas.buffers(0), 0, timeout_s=30)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds: the kernel polls meanwhile
        box.copy_(staged)
    torch.cuda.synchronize()
    conn.send("equal" if torch.equal(out, ar.all_reduce_ref(x)) else "wrong sum")


@pytest.mark.skipif(CPU_MODE, reason="needs a second stream running beside the kernel")
def test_a_late_peer_is_waited_for():
    """The peer's words land while the kernel already polls (a second stream writes them after
    a sleep): it waits, then sums them."""
    assert _in_a_process(_wait_for_a_late_peer) == "equal"


def _wait_for_a_peer_that_never_comes(conn) -> None:
    areas = Areas(2)
    x = _parts(2, 4096, torch.bfloat16, seed=1)
    # a first call, its peer's words staged: compiled before the clock starts
    areas.box(0, 0, 1)[:2048] = _words(x[1]) | ar.ARRIVED
    ar.all_reduce(x[0], areas.buffers(0), 0, timeout_s=30)
    time_a_trap(conn, lambda: ar.all_reduce(x[0], areas.buffers(0), 1, timeout_s=0.2))


@pytest.mark.skipif(CPU_MODE, reason="the deadline reads the GPU's clock")
def test_a_peer_that_never_comes_fails_the_context_instead_of_hanging():
    """Past its deadline the kernel traps: the CUDA context fails and the host's next wait
    raises, no sooner than the deadline."""
    assert_trapped_in_a_process(_wait_for_a_peer_that_never_comes, 0.2)


# A projection that sends its output from its epilogue (ar.Push), and the all-reduce after it
# that only waits and sums (pushed=True): o's shape (one split of K) and down's (K split, the
# words sent by the split-sum kernel).
PUSH_CASES = [(3, 64, 48, None), (5, 96, 256, lt.LinearConfig(16, 32, 32, split_k=2))]


def _projections(rows: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(rows, k, generator=g) / 4).to(dtype).to(DEV) for _ in range(2)]
    ws = [(torch.randn(n, k, generator=g) / 8).to(dtype).to(DEV) for _ in range(2)]
    return xs, ws


@pytest.mark.parametrize("dtype", [torch.float16] + ([] if CPU_MODE else [torch.bfloat16]))
@pytest.mark.parametrize("rows,n,k,config", PUSH_CASES)
def test_a_projection_pushes_its_output_and_the_all_reduce_sums_it(dtype, rows, n, k, config):
    """Each rank's projection stores its output (bit for bit what it returns) with the flag into
    its box of the slot in the other's area and nowhere else; then each rank's fused add and
    norm, told the words were pushed, sends nothing, sums both ranks' outputs as the reference
    does and leaves its box zeroed."""
    areas, slot = Areas(2), 1
    xs, ws = _projections(rows, n, k, dtype, seed=rows)
    outs = []
    for rank in range(2):
        push = ar.Push(areas.buffers(rank), slot)
        out = lf.linear_partial(xs[rank], ws[rank], config, push=push)
        assert isinstance(out, Pushed) and out.slot == slot
        words = out.x.numel() // 2
        box = areas.box(1 - rank, slot, rank)
        assert torch.equal(box[:words], _words(out.x) | ar.ARRIVED)
        assert not box[words:].any()
        outs.append(out.x)
    assert torch.equal(outs[0], lf.linear_partial(xs[0], ws[0], config))  # the same output
    for rank in range(2):  # nothing in the other slot, nor in a rank's own box
        for s in range(2):
            assert not areas.box(rank, s, rank).any()
        assert not areas.box(rank, 1 - slot, 1 - rank).any()
    g = torch.Generator().manual_seed(n)
    residual = (torch.randn(rows, n, generator=g) * 4).to(dtype).to(DEV)
    weight = (torch.rand(n, generator=g) + 0.5).to(dtype).to(DEV)
    want_normed, want_summed = ar.all_reduce_add_rms_norm_ref(outs, residual, weight, 1e-5)
    for rank in range(2):
        normed, summed = ar.all_reduce_add_rms_norm(outs[rank], residual, weight, 1e-5,
                                                    areas.buffers(rank), slot, timeout_s=30,
                                                    pushed=True)
        assert torch.equal(summed, want_summed)
        ulp = torch.finfo(dtype).eps * want_normed.float().abs().clamp_min(1e-3)
        assert ((normed.float() - want_normed.float()).abs() <= ulp).all()
        assert not areas.box(rank, slot, 1 - rank).any()  # read and zeroed
    # rank 1 summed after rank 0 had read and zeroed its box: a reduce that sent its words
    # again would have refilled it
    assert not any(a.any() for a in areas.areas)


def test_the_plain_all_reduce_takes_pushed_words_too():
    areas, slot = Areas(2), 0
    xs, ws = _projections(4, 64, 32, torch.float16, seed=11)
    outs = [lf.linear_partial(xs[r], ws[r], push=ar.Push(areas.buffers(r), slot)).x
            for r in range(2)]
    want = ar.all_reduce_ref(outs)
    for rank in range(2):
        got = ar.all_reduce(outs[rank], areas.buffers(rank), slot, timeout_s=30, pushed=True)
        assert torch.equal(got, want)
        assert not areas.box(rank, slot, 1 - rank).any()


def test_what_cannot_be_pushed_is_computed_without_a_push():
    """An odd width, or 32-bit elements: the projection runs as before and says it pushed
    nothing (a tensor, not a Pushed), and no word reaches a peer."""
    areas = Areas(2)
    push = ar.Push(areas.buffers(0), 0)
    assert push.fits(4, 64, torch.float16) and not push.fits(4, 63, torch.float16)
    assert not push.fits(4, 64, torch.float32) and not push.fits(0, 64, torch.float16)
    assert not push.fits(1, 2 * MAX_WORDS + 2, torch.float16)
    xs, ws = _projections(4, 63, 32, torch.float16, seed=5)
    out = lf.linear_partial(xs[0], ws[0], push=push)
    assert isinstance(out, torch.Tensor)
    assert not any(a.any() for a in areas.areas)
    with pytest.raises(ValueError, match="push"):
        lt._launch(xs[0], None, None, 0.0, ws[0], None, None, push=push)


def test_at_three_ranks_a_projection_pushes_to_both_peers():
    """The last of three ranks: its projection's words land in box 2 of both peers' areas, and
    its pushed all-reduce, both peers' words staged, sums the three parts in rank order."""
    areas, slot = Areas(3), 1
    xs, ws = _projections(4, 64, 32, torch.float16, seed=13)
    out = lf.linear_partial(xs[0], ws[0], push=ar.Push(areas.buffers(2), slot)).x
    words = out.numel() // 2
    for q in (0, 1):
        assert torch.equal(areas.box(q, slot, 2)[:words], _words(out) | ar.ARRIVED)
    parts = [lf.linear_partial(xs[1], ws[1]), lf.linear_partial(xs[0], ws[1]), out]
    for q in (0, 1):
        areas.box(2, slot, q)[:words] = _words(parts[q]) | ar.ARRIVED
    got = ar.all_reduce(out, areas.buffers(2), slot, timeout_s=30, pushed=True)
    assert torch.equal(got, ar.all_reduce_ref(parts))
    assert not areas.box(2, slot, 0).any() and not areas.box(2, slot, 1).any()
