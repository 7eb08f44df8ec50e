"""Quantized weights and the fp8 KV cache on two GPUs: async with graphs gives sync's tokens at
tensor_parallel_size 2, each engine in a process of its own (as
tests/test_gpu_tensor_parallel.py runs them). Skipped unless two CUDA devices are visible."""
import pytest
import torch

from test_engine import _mixed_requests, _same
from tp_helpers import engine_in_a_process

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("fp8", "auto"), ("fp8", "fp8"),
                                                          ("int4", "auto")])
def test_async_graphs_equal_sync_at_size_2(quantization, kv_cache_dtype):
    # llama-1b: its projections' input dims split into whole int4 groups at size 2
    reqs = _mixed_requests(16, seed=6)
    opts = dict(device="cuda", dtype="bfloat16", max_batch=16, num_kv_blocks=256,
                max_model_len=256, buckets=[1, 2, 4, 8, 16], tensor_parallel_size=2,
                quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    want, _, _ = engine_in_a_process("llama-1b", dict(opts, async_scheduling=False), reqs)
    got, breaks, _ = engine_in_a_process("llama-1b", dict(opts, async_scheduling=True), reqs)
    _same(want, got)
    assert breaks == 0


def test_llama_8b_fp8_from_w8a8_rows_at_size_2():
    """llama-8b in fp8 at tensor_parallel_size 2 with up to 48 rows a step: W8A8 (from 17
    rows, kernels/linear_w8a8_triton.py) and W8A16 below, each rank's half of every
    projection; async with graphs gives sync's tokens."""
    reqs = _mixed_requests(48, seed=8)
    opts = dict(device="cuda", dtype="bfloat16", max_batch=48, num_kv_blocks=512,
                max_model_len=256, buckets=[1, 8, 16, 32, 48], tensor_parallel_size=2,
                quantization="fp8")
    want, _, _ = engine_in_a_process("llama-8b", dict(opts, async_scheduling=False), reqs)
    got, breaks, _ = engine_in_a_process("llama-8b", dict(opts, async_scheduling=True), reqs)
    _same(want, got)
    assert breaks == 0
