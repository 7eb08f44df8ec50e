"""The embedding gather (kernels/embedding_triton.py) against its reference, F.embedding: a
copy, so bitwise equal, every output element written (the output is poisoned first)."""
import pytest
import torch

from graphexec.kernels.embedding import embedding_ref
from kernel_helpers import DEV, _randn, big, kernel_test


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,vocab,hidden", big(
    [(1, 128256, 2048), (64, 32000, 4096), (300, 1000, 896), (7, 50, 3000)],
    [(1, 50, 64), (5, 37, 96), (3, 20, 1100)]))
def test_embedding_gather(monkeypatch, dtype, tokens, vocab, hidden):
    from graphexec.kernels import embedding_triton
    from kernel_helpers import _poisoned_empty
    monkeypatch.setattr(embedding_triton, "_new", _poisoned_empty)
    weight = _randn((vocab, hidden), dtype, 60)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))
    ids[0] = vocab - 1  # the last row too
    ids = ids.to(DEV)
    out = embedding_triton.embedding(ids, weight)
    assert torch.equal(out, embedding_ref(ids, weight))


@kernel_test
@pytest.mark.gpu
def test_embedding_of_no_tokens():
    from graphexec.kernels import embedding_triton
    weight = _randn((10, 64), torch.bfloat16, 61)
    out = embedding_triton.embedding(torch.empty(0, dtype=torch.int64, device=DEV), weight)
    assert out.shape == (0, 64)
