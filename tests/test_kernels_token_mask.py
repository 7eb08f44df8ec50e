"""Grammar token masks: the reference against a bit-by-bit loop, the Triton kernel against the
reference."""
import pytest
import torch

from graphexec.kernels.token_mask import apply_token_mask_ref
from kernel_helpers import DEV, _gen, big, kernel_test


def _inputs(b, v, seed):
    g = _gen(seed)
    w = (v + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (b, w), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = -1  # everything allowed
    mask[1] = 0
    mask[1, 0] = 1 << 3  # token 3 alone
    on = torch.tensor([i % 4 != 3 for i in range(b)])  # every fourth row has no grammar
    return torch.randn(b, v, generator=g), mask, on


def test_reference_matches_a_bit_loop():
    logits, mask, on = _inputs(5, 70, 1)
    got = apply_token_mask_ref(logits.clone(), mask, on)
    want = logits.clone()
    for i in range(5):
        for t in range(70):
            if on[i] and not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                want[i, t] = float("-inf")
    assert torch.equal(got, want)
    assert torch.isfinite(got[1]).sum() == 1 and torch.isfinite(got[1, 3])
    assert torch.equal(got[3], logits[3])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", big([(8, 128256), (5, 49152), (3, 1000)], [(8, 300), (5, 2100)]))
def test_token_mask_matches_reference(K, dtype, b, v):
    from graphexec.kernels.token_mask_triton import apply_token_mask
    logits, mask, on = _inputs(b, v, 2)
    logits, mask, on = logits.to(DEV, dtype), mask.to(DEV), on.to(DEV)
    ref = apply_token_mask_ref(logits.clone(), mask, on)
    out = apply_token_mask(logits.clone(), mask, on)
    assert torch.equal(out, ref)
