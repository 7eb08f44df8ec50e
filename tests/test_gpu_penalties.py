"""Penalties, logit bias and min_p on CUDA: the captured penalties variant (async, graphs) equals
sync eager steps token for token."""
import pytest
import torch

from graphexec import Engine
from graphexec.plan import Variant
from test_engine import _same, run_engine
from test_penalties import penalised_requests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(**kw):
    return Engine("tiny", device="cuda", dtype="float32", max_batch=8, num_kv_blocks=256,
                  max_num_batched_tokens=64, **kw)


def test_captured_penalties_equal_sync_eager():
    reqs = penalised_requests(32, seed=11)
    eager = run_engine(_engine(async_scheduling=False, cuda_graphs=False), reqs)
    engine = _engine(async_scheduling=True, cuda_graphs=True)
    graphs = engine.runner.graphs
    assert graphs.has(8, Variant(False, True, penalties=True))
    assert (64, False, True, False) in graphs.prefill
    _same(eager, run_engine(engine, reqs))

