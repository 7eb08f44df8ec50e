"""kernels/publish_triton.py against kernels/publish.py: results into a host ring, the slot
picked by a device counter. On CUDA the ring is pinned host memory, as capture/results.py's
ResultRing uses it."""
import pytest
import torch

from graphexec.kernels.publish import publish_ref
from kernel_helpers import CPU_MODE, DEV, RUNNABLE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not RUNNABLE, reason="needs Triton")]


def _ring(slots, rows, width):
    pinned = DEV.type == "cuda"
    return torch.full((slots, rows, width), -7, dtype=torch.int64, pin_memory=pinned)


@pytest.mark.parametrize("rows,width", [(1, 2), (64, 2), (37, 6), (300, 9)])
def test_publish_matches_reference_and_walks_the_ring(rows, width):
    from graphexec.kernels.publish_triton import publish
    slots, cap = 3, rows + 5
    ring, ring_ref = _ring(slots, cap, width), _ring(slots, cap, width)
    counter = torch.tensor([5], dtype=torch.int64, device=DEV)
    counter_ref = counter.clone()
    g = torch.Generator().manual_seed(rows)
    for _ in range(slots + 2):  # wraps around: later launches overwrite the first slots
        src = torch.randint(0, 1 << 40, (rows, width), generator=g).to(DEV)
        publish(src, ring, counter)
        publish_ref(src, ring_ref, counter_ref)
        if DEV.type == "cuda":
            torch.cuda.synchronize()  # the host reads the ring only after the stream
        assert torch.equal(ring[(int(counter) - 1) % slots, :rows], src.cpu())
    assert int(counter) == int(counter_ref) == 5 + slots + 2
    assert torch.equal(ring, ring_ref)  # rows past the source untouched (-7) in both


def test_publish_rejects_what_does_not_fit():
    from graphexec.kernels.publish_triton import publish
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="does not fit"):
        publish(torch.zeros(9, 2, dtype=torch.int64, device=DEV), _ring(3, 8, 2), counter)
    with pytest.raises(ValueError, match="dtype"):
        publish(torch.zeros(4, 2, dtype=torch.int32, device=DEV), _ring(3, 8, 2), counter)


@pytest.mark.skipif(CPU_MODE, reason="graph capture needs CUDA")
def test_publish_in_a_graph_walks_the_ring_on_replay():
    """Captured once, each replay lands in the next slot: the host never passes the slot."""
    from graphexec.kernels.publish_triton import publish
    ring = _ring(4, 8, 2)
    counter = torch.zeros(1, dtype=torch.int64, device=DEV)
    src = torch.zeros(8, 2, dtype=torch.int64, device=DEV)
    publish(src, ring, counter)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        publish(src, ring, counter)
    for i in range(6):
        src.fill_(100 + i)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ring[(1 + i) % 4], torch.full((8, 2), 100 + i))
