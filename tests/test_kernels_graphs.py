"""The Triton ops table, kernels inside a CUDA graph, and the interpreter run of every kernel
test on the CPU."""
import glob
import os
import subprocess
import sys
import tempfile

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


# Seconds each kernel test file takes under the interpreter on a CI machine (2026-11-26); a file
# not named here counts as one. They balance the interpreter's processes.
INTERPRETER_SECONDS = {"test_kernels_attention.py": 91, "test_kernels_sampling.py": 86,
                       "test_kernels_fused_linear.py": 53, "test_kernels_linear.py": 47}


def _balanced(files: list[str], groups: int) -> list[list[str]]:
    """files in `groups` lists of about equal interpreter time, the longest placed first."""
    out: list[list[str]] = [[] for _ in range(groups)]
    load = [0.0] * groups
    for f in sorted(files, key=lambda f: -INTERPRETER_SECONDS.get(os.path.basename(f), 1)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += INTERPRETER_SECONDS.get(os.path.basename(f), 1)
    return [g for g in out if g]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CPU_MODE, reason="already running under the interpreter")
def test_kernels_in_triton_interpreter():
    """Runs every kernel test file on the CPU through TRITON_INTERPRET=1, in one process per
    core (up to two): the interpreter runs on one, and it is most of the CPU suite's time
    (about 280 s in one process)."""
    env = dict(os.environ, TRITON_INTERPRET="1", GRAPHEXEC_KERNEL_DEVICE="cpu",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    files = sorted(glob.glob(os.path.join(here, "test_kernels_*.py")))
    groups = _balanced(files, max(1, min(2, os.cpu_count() or 1)))
    # output to files, not pipes: a process whose pipe filled up would wait for a reader
    logs = [tempfile.TemporaryFile(mode="w+") for _ in groups]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pytest", *group, "-m", "gpu", "-q", "-x",
         "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        cwd=os.path.dirname(here)) for group, log in zip(groups, logs)]
    try:
        codes = [proc.wait(timeout=900) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for group, code, log in zip(groups, codes, logs):
        log.seek(0)
        out = log.read()
        tail = f"{[os.path.basename(f) for f in group]}\n{out[-9000:]}"
        assert code == 0, tail
        assert " passed" in out, tail
