"""Structured outputs on CUDA: the captured grammar variant (async, graphs) equals sync eager
steps token for token, and every complete output validates; steps that take their masks after
launch (capture/mask_gate.py) equal steps whose masks were built before it.

The tiny preset with a tokenizer trained to its vocabulary (tools/synthetic_tokenizer.py): the
GPU machine has no model files."""
import dataclasses
import functools
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from graphexec import Engine
from graphexec.plan import Variant
from test_engine import _same, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
MODEL = "tiny"


@functools.cache
def _tokenizer():
    import synthetic_tokenizer

    return synthetic_tokenizer.for_model(MODEL)


def _engine(**opts) -> Engine:
    engine = Engine(MODEL, **opts)
    engine.tokenizer = _tokenizer()
    return engine


def _run(reqs: list, **opts) -> tuple[Engine, dict]:
    engine = _engine(**opts)
    return engine, run_engine(engine, [(rid, p, sp) for rid, p, sp, _ in reqs])


def _valid(engine: Engine, outs: dict, reqs: list) -> int:
    from test_structured_outputs import check_output

    eos = engine.model_config.eos_token_ids
    return sum(check_output(outs[rid], sp, c, eos) for rid, _, sp, c in reqs)


def _graphs_equal_eager(reqs: list, variant: Variant, **extra) -> tuple[Engine, dict]:
    """Runs reqs on a sync eager engine and on an async one with graphs (which must hold
    `variant`); asserts the same tokens and that some complete outputs validate."""
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_batch=8,
                max_num_batched_tokens=128, **extra)
    _, eager = _run(reqs, async_scheduling=False, cuda_graphs=False, **opts)
    engine, graphs = _run(reqs, async_scheduling=True, cuda_graphs=True, **opts)
    assert engine.runner.graphs.has(8, variant)
    _same(eager, graphs)
    assert _valid(engine, graphs, reqs) >= 1
    return engine, graphs


def test_captured_grammar_rows_equal_sync_eager():
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from test_structured_outputs import _requests

    engine, _ = _graphs_equal_eager(_requests(24, seed=7),
                                    Variant(False, True, penalties=True, grammar=True))
    assert engine.runner.mask_gate.released > 0  # decode replays took their masks late


def test_captured_grammar_rows_under_speculation_equal_sync_eager():
    """Speculative engines: grammar rows take no drafts and are masked at the step's first
    position, in the captured iteration as in eager sync steps; outputs validate."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from graphexec import SpeculativeConfig
    from test_structured_outputs import _requests

    reqs = _requests(16, seed=8)
    engine, graphs = _graphs_equal_eager(reqs, Variant(False, True, penalties=True, grammar=True),
                                         speculative=SpeculativeConfig("self:1", 3))
    assert engine.runner.mask_gate is None  # it reads each grammar step before the next
    assert all(graphs[rid].num_drafted_tokens == 0 for rid, _, _, c in reqs if c is not None)


def test_masks_after_launch_equal_masks_before_it(monkeypatch):
    """Async with graphs: steps that wait on the device for their masks give the tokens of
    steps that read the step before and build the masks before launching (the path of
    speculative and tensor-parallel engines), with joins and finishes among them."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from graphexec import rank
    from test_structured_outputs import _requests

    reqs = _requests(40, seed=9, lengths=(8, 40, 120))
    for i in (5, 17):  # a chunk that asks for prompt logprobs runs eagerly: the drained path
        rid, prompt, sp, check = reqs[i]
        reqs[i] = (rid, prompt, dataclasses.replace(sp, prompt_logprobs=1), check)
    # fp32: the drained engine plans after reading the step in flight, so its batches differ
    # from the gated one's, and bf16 logits move with the batch
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_batch=16,
                max_num_batched_tokens=256, async_scheduling=True)
    gated, after = _run(reqs, **opts)
    monkeypatch.setattr(rank, "defers_masks", lambda cfg, shard: False)
    drained, before = _run(reqs, **opts)
    assert drained.runner.mask_gate is None
    # replays took their masks late; the eager steps (prompt logprobs) read the step in flight
    late = gated.runner.mask_gate.released
    assert late > 0 and 0 < gated.stats.grammar_waits < drained.stats.grammar_waits
    _same(before, after)
    assert _valid(gated, after, reqs) >= 1


def _captured_pull(gate):
    """A CUDA graph of gate.pull(), as the decode graphs hold it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate.pull()
    return graph


def _gate(rows: int, mask_words: int):
    from graphexec.capture.mask_gate import MaskGate

    words = -(-mask_words // 2) + 1  # DecodeState.grammar_rows' row: the mask, then the flag
    return MaskGate(torch.zeros(rows, words, dtype=torch.int64, device="cuda"),
                    torch.zeros(1, dtype=torch.int64, device="cuda"), mask_words)


def test_the_device_waits_for_the_flag():
    """kernels/mask_gate_triton.py in a graph: the copy does not happen before the host raises
    the flag to the step's ticket, a flag at an earlier ticket lets nothing through, and once
    raised the rows in use arrive whole (against the reference's copy)."""
    from graphexec.kernels.mask_gate import await_masks_ref

    gate = _gate(9, 4009)
    graph = _captured_pull(gate)
    rng = np.random.default_rng(0)
    for step, num_rows in enumerate((9, 4)):
        gate.host_masks[:] = rng.integers(-2**31, 2**31, size=gate.host_masks.shape)
        gate.host_flags[:] = rng.integers(0, 3, size=gate.host_flags.shape)
        gate.num_rows.fill_(num_rows)
        ticket = gate.arm()
        before, passed = gate.rows.cpu(), gate.passed.cpu()
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the copy ran before its ticket was released"
        if step:  # the flag stands at the last step's ticket
            assert gate.flag.item() == ticket - 1
        gate.release(ticket)
        done.synchronize()
        want = await_masks_ref(gate.flag, passed, gate.num_rows.cpu(), gate.masks, gate.flags,
                               before)
        assert torch.equal(gate.rows.cpu(), want)
        assert int(gate.passed) == int(passed) == ticket


def test_a_release_from_another_thread_lets_the_step_through():
    """The host may release while the device already spins (the usual order under async)."""
    gate = _gate(4, 198)
    graph = _captured_pull(gate)
    gate.num_rows.fill_(4)
    ticket = gate.arm()
    graph.replay()

    def fill_and_release():  # the rows are written while the device already spins
        gate.host_masks[:] = 7
        gate.host_flags[:] = 1
        gate.release(ticket)

    threading.Timer(0.1, fill_and_release).start()
    torch.cuda.synchronize()
    assert torch.equal(gate.rows[:, -1].cpu(), torch.ones(4, dtype=torch.int64))
    assert bool((gate.rows[:, :-1].view(torch.int32)[:, :gate.masks.shape[1]] == 7).all())


def test_an_error_mid_step_leaves_no_step_waiting(monkeypatch):
    """An exception between a gated step's launch and its release (here in reading the step
    before it) releases it: the device finishes, and the engine closes, well before the wait's
    deadline."""
    pytest.importorskip("xgrammar")
    from test_structured_outputs import _requests

    engine = _engine(device="cuda", max_model_len=256, max_batch=8, async_scheduling=True)
    for rid, prompt, sp, _ in _requests(8, seed=3, lengths=(60,)):
        engine.add_request(rid, prompt, sp)
    gate = engine.runner.mask_gate
    while gate.issued < 3:
        engine.step()
    reconcile = engine._reconcile

    def fails(step):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_reconcile", fails)
    with pytest.raises(KeyboardInterrupt):
        while True:
            engine.step()
    assert gate.released == gate.issued
    t0 = time.monotonic()
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 10
    monkeypatch.setattr(engine, "_reconcile", reconcile)
    engine.close()
