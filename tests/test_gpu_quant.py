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


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fp8_kv_cache_async_graphs_equal_sync(quantization):
    """The e4m3 cache through the fused rope + decode attention, the mixed steps' prefill
    attention and the graphs; prefix caching on, so later prompts read blocks earlier ones
    wrote."""
    reqs = _mixed_requests(40, seed=9)
    opts = dict(kv_cache_dtype="fp8", quantization=quantization, enable_prefix_caching=True)
    sync_g = _engine(async_scheduling=False, **opts)
    assert sync_g.kv.k[0].dtype == torch.float8_e4m3fn
    sync_out = run_engine(sync_g, reqs)
    _same(sync_out, run_engine(_engine(**opts), reqs))


def test_fp8_kv_cache_with_a_self_draft():
    reqs = _mixed_requests(16, seed=4)
    spec = dict(speculative=SpeculativeConfig("self:1", 3), max_batch=16,
                buckets=[1, 2, 4, 8, 16], kv_cache_dtype="fp8")
    sync_out = run_engine(_engine(async_scheduling=False, **spec), reqs)
    _same(sync_out, run_engine(_engine(**spec), reqs))


def test_fp8_kv_cache_doubles_the_blocks_in_the_same_memory():
    opts = dict(kv_cache_memory=64 << 20, num_kv_blocks=None, max_model_len=512,
                cuda_graphs=False)
    dense, fp8 = _engine(**opts), _engine(kv_cache_dtype="fp8", **opts)
    assert fp8.pool.num_blocks == 2 * dense.pool.num_blocks
