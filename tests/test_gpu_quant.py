"""On the GPU, quantized weights inside the captured iteration: async + graphs equal sync in
each format (the 33-64-row buckets too, where the dense set would fuse epilogues), and a
self-draft running the target's quantized layers."""
import pytest
import torch

from graphexec import Engine, SpeculativeConfig
from graphexec.kernels.quant import QuantizedWeight
from test_engine import _mixed_requests, _same, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FORMATS = ["fp8", "int4", "int4_asym"]


def _engine(**kw):
    opts = dict(device="cuda", dtype="bfloat16", max_batch=64, num_kv_blocks=1024,
                buckets=[1, 2, 4, 8, 16, 32, 48, 64])
    opts.update(kw)
    return Engine("tiny", **opts)


@pytest.mark.parametrize("quantization", FORMATS)
def test_async_graphs_equal_sync(quantization):
    reqs = _mixed_requests(60, seed=7)
    sync_g = _engine(quantization=quantization, async_scheduling=False)
    assert isinstance(sync_g.model.weights.layers[0].down, QuantizedWeight)
    assert "quantized" in sync_g.model.ops.name
    sync_out = run_engine(sync_g, reqs)
    async_g = _engine(quantization=quantization)
    _same(sync_out, run_engine(async_g, reqs))
    assert async_g.pool.num_free == async_g.pool.num_blocks


@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_self_draft_runs_the_quantized_layers(quantization):
    reqs = _mixed_requests(16, seed=3)
    spec = dict(speculative=SpeculativeConfig("self:1", 3), max_batch=16,
                buckets=[1, 2, 4, 8, 16], quantization=quantization)
    sync_out = run_engine(_engine(async_scheduling=False, **spec), reqs)
    _same(sync_out, run_engine(_engine(**spec), reqs))
