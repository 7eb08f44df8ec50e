"""Structured outputs on CUDA: the captured grammar variant (async, graphs) equals sync eager
steps token for token, and every complete output validates."""
import pytest
import torch

from graphexec import Engine
from graphexec.plan import Variant
from test_engine import _same, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _graphs_equal_eager(reqs: list, variant: Variant, **extra) -> tuple[Engine, dict]:
    """Runs reqs on a sync eager engine and on an async one with graphs (which must hold
    `variant`); asserts the same tokens and that enough complete outputs validate."""
    from test_structured_outputs import MODEL, check_output

    params = [(rid, p, sp) for rid, p, sp, _ in reqs]
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_batch=8,
                max_num_batched_tokens=128, **extra)
    eager = run_engine(Engine(MODEL, async_scheduling=False, cuda_graphs=False, **opts), params)
    engine = Engine(MODEL, async_scheduling=True, cuda_graphs=True, **opts)
    assert engine.runner.graphs.has(8, variant)
    graphs = run_engine(engine, params)
    _same(eager, graphs)
    eos = engine.model_config.eos_token_ids
    assert sum(check_output(graphs[rid], sp, c, eos) for rid, _, sp, c in reqs) >= len(reqs) // 3
    return engine, graphs


def test_captured_grammar_rows_equal_sync_eager():
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from test_structured_outputs import _requests

    _graphs_equal_eager(_requests(24, seed=7), Variant(False, True, penalties=True, grammar=True))


def test_captured_grammar_rows_under_speculation_equal_sync_eager():
    """Speculative engines: grammar rows take no drafts and are masked at the step's first
    position, in the captured iteration as in eager sync steps; outputs validate."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from graphexec import SpeculativeConfig
    from test_structured_outputs import _requests

    reqs = _requests(16, seed=8)
    _, graphs = _graphs_equal_eager(reqs, Variant(False, True, penalties=True, grammar=True),
                                    speculative=SpeculativeConfig("self:15", 3))
    assert all(graphs[rid].num_drafted_tokens == 0 for rid, _, _, c in reqs if c is not None)
