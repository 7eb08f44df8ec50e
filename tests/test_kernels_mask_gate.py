"""The captured wait for a step's grammar masks (kernels/mask_gate_triton.py) against its
reference, with the flag already released: only the rows in use are written, each gets its
grammar flag, and only rows whose flag is set get their mask words. The wait itself (the
device polling while the host releases) is in tests/test_gpu_structured.py."""
import pytest
import torch

from graphexec.kernels.mask_gate import await_masks_ref
from kernel_helpers import CPU_MODE, DEV, _gen, big, kernel_test


def _host(rows: int, mask_words: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(masks [rows, mask_words] int32, flags [rows] int64): every third row has no grammar
    (its mask words stay behind), the others flag 1 (MASK_ON) or 2 (MASK_HOLD)."""
    g = _gen(seed)
    masks = torch.randint(-2**31, 2**31, (rows, mask_words), generator=g, dtype=torch.int64)
    flags = torch.tensor([i % 3 for i in range(rows)], dtype=torch.int64)
    return masks.to(torch.int32), flags


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("rows,mask_words,num_rows",
                         big([(65, 4008, 64), (65, 4009, 7), (9, 4008, 0)],
                             [(7, 79, 5), (7, 6000, 6), (4, 80, 0)]))
def test_await_masks_matches_reference(K, rows, mask_words, num_rows):
    from graphexec.kernels.mask_gate_triton import await_masks

    pin = dict(pin_memory=not CPU_MODE)
    masks, flags = _host(rows, mask_words, 3)
    masks_host = torch.empty(masks.shape, dtype=torch.int32, **pin).copy_(masks)
    flags_host = torch.empty(flags.shape, dtype=torch.int64, **pin).copy_(flags)
    flag = torch.tensor([9], dtype=torch.int64, **pin)  # released through ticket 9
    row_words = -(-mask_words // 2) + 1
    before = torch.randint(-2**62, 2**62, (rows, row_words), generator=_gen(4),
                           dtype=torch.int64)
    passed = torch.tensor([8], dtype=torch.int64)
    want = await_masks_ref(flag, passed.clone(), torch.tensor([num_rows]), masks, flags,
                           before.clone())
    dst, passed_dev = before.to(DEV), passed.to(DEV)
    await_masks(flag, passed_dev, torch.tensor([num_rows], device=DEV), masks_host, flags_host,
                dst)
    assert torch.equal(dst.cpu(), want)
    assert int(passed_dev) == 9
    if num_rows:
        assert torch.equal(want[:num_rows, -1], flags[:num_rows])
        words = want[:, :-1].view(torch.int32)
        assert torch.equal(words[1, :mask_words], masks[1])  # row 1 is flagged
        assert torch.equal(want[0, :-1], before[0, :-1])  # row 0 has no grammar
        if mask_words % 2:  # the pad word after an odd-sized mask is left as it was
            assert torch.equal(words[1, mask_words:], before[:, :-1].view(torch.int32)[
                1, mask_words:])
    assert torch.equal(want[num_rows:], before[num_rows:])
