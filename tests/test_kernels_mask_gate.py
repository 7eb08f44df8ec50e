"""The captured wait for a step's grammar masks (kernels/mask_gate_triton.py) against its
reference, with the flag already released: only the rows in use are written, each gets its
grammar flag, and only rows whose flag is set get their mask words. The wait itself (the
device polling while the host releases) is in tests/test_gpu_structured.py."""
import pytest
import torch

from graphexec.kernels.mask_gate import await_masks_ref
from kernel_helpers import CPU_MODE, DEV, _gen, big, kernel_test


def _rows(rows: int, words: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    src = torch.randint(-2**62, 2**62, (rows, words), generator=g, dtype=torch.int64)
    src[::3, -1] = 0  # every third row has no grammar: its mask words stay behind
    src[1::3, -1] = 1
    src[2::3, -1] = 2
    return src


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("rows,words,num_rows",
                         big([(65, 2005, 64), (65, 2005, 7), (9, 2005, 0)],
                             [(7, 40, 5), (7, 3000, 6), (4, 40, 0)]))
def test_await_masks_matches_reference(K, rows, words, num_rows):
    from graphexec.kernels.mask_gate_triton import await_masks

    pin = dict(pin_memory=not CPU_MODE)
    src = _rows(rows, words, 3)
    src_host = torch.empty(src.shape, dtype=torch.int64, **pin).copy_(src)
    flag = torch.tensor([9], dtype=torch.int64, **pin)  # released through ticket 9
    before = torch.randint(-2**62, 2**62, (rows, words), generator=_gen(4), dtype=torch.int64)
    passed = torch.tensor([8], dtype=torch.int64)
    want = await_masks_ref(flag, passed.clone(), torch.tensor([num_rows]), src, before.clone())
    dst, passed_dev = before.to(DEV), passed.to(DEV)
    await_masks(flag, passed_dev, torch.tensor([num_rows], device=DEV), src_host, dst)
    assert torch.equal(dst.cpu(), want)
    assert int(passed_dev) == 9
    if num_rows:
        assert not torch.equal(want[0, :-1], src[0, :-1])  # row 0 has no grammar
        assert torch.equal(want[1], src[1])
    assert torch.equal(want[num_rows:], before[num_rows:])
