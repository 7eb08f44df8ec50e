"""The Triton ops table, kernels inside a CUDA graph, and the interpreter run of every kernel
test on the CPU."""
import glob
import os
import subprocess
import sys

import pytest
import torch

from kernel_helpers import (
    CPU_MODE, DEV, HAS_TRITON, RUNNABLE, _check, _paged_cache, _randn,
    _sample_inputs, attn_ref, kernel_test, samp_ref)


@kernel_test
@pytest.mark.gpu
def test_ops_table(K):
    from graphexec.kernels import REFERENCE_OPS
    assert K.ops.name == "triton"
    assert K.ops.mask_stop_tokens is not REFERENCE_OPS.mask_stop_tokens
    assert K.ops.logprobs is REFERENCE_OPS.logprobs


# ----------------------------------------------------------------------------------------------
# CUDA graphs (real GPU only)


@pytest.mark.gpu
@pytest.mark.skipif(CPU_MODE or not RUNNABLE, reason="needs CUDA")
def test_cuda_graph_capture_and_replay(K):
    """Decode attention and sampling captured once, replayed after the device inputs change
    (longer contexts, other seeds/steps): the replays match fresh reference calls."""
    dtype = torch.bfloat16
    b, hq, hk, d, bs = 8, 8, 2, 64, 16
    lens = [5, 40, 100, 16, 17, 1, 63, 200]
    kc, vc, _, _, tables = _paged_cache([300] * b, hk, d, bs, dtype, 80)
    q = _randn((b, hq, d), dtype, 81)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    logits, temps, ks, ps, seeds, steps = _sample_inputs(b, 1000, 82)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compiles) outside the capture
            K.ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5)
            K.ops.sample(logits, temps, ks, ps, seeds, steps)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.ops.decode_attention(q, kc, vc, tables, sl, d ** -0.5)
        tok = K.ops.sample(logits, temps, ks, ps, seeds, steps)
    for it in range(3):
        sl.add_(it * 7)
        steps.add_(1)
        q.copy_(_randn((b, hq, d), dtype, 90 + it))
        logits.copy_(_sample_inputs(b, 1000, 95 + it)[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = attn_ref.paged_decode_attention_ref(q, kc, vc, tables, sl, d ** -0.5)
        _check(out, ref, dtype, "attention")
        assert torch.equal(tok, samp_ref.sample_ref(logits, temps, ks, ps, seeds, steps))


# ----------------------------------------------------------------------------------------------
# The interpreter run (CPU)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CPU_MODE, reason="already running under the interpreter")
def test_kernels_in_triton_interpreter():
    """Runs every kernel test file on the CPU through TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", GRAPHEXEC_KERNEL_DEVICE="cpu",
               CUDA_VISIBLE_DEVICES="")
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(here, "test_kernels_*.py")))
    cmd = [sys.executable, "-m", "pytest", *files, "-m", "gpu", "-q", "-x",
           "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tail = (res.stdout[-6000:] + "\n" + res.stderr[-3000:])
    assert res.returncode == 0, tail
    assert " passed" in res.stdout, tail
