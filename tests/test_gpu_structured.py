"""Structured outputs on CUDA: the captured grammar variant (async, graphs) equals sync eager
steps token for token, and every complete output validates."""
import pytest
import torch

from graphexec import Engine
from graphexec.plan import Variant
from test_engine import _same, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_captured_grammar_rows_equal_sync_eager():
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from test_structured_outputs import MODEL, _requests, check_output

    reqs = _requests(24, seed=7)
    params = [(rid, p, sp) for rid, p, sp, _ in reqs]
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_batch=8,
                max_num_batched_tokens=128)
    eager = run_engine(Engine(MODEL, async_scheduling=False, cuda_graphs=False, **opts), params)
    engine = Engine(MODEL, async_scheduling=True, cuda_graphs=True, **opts)
    assert engine.runner.graphs.has(8, Variant(False, True, penalties=True, grammar=True))
    graphs = run_engine(engine, params)
    _same(eager, graphs)
    eos = engine.model_config.eos_token_ids[0]
    assert sum(check_output(graphs[rid], sp, c, eos) for rid, _, sp, c in reqs) >= 10


def test_captured_grammar_rows_under_speculation_equal_sync_eager():
    """Speculative engines: grammar rows take no drafts and are masked at the step's first
    position, in the captured iteration as in eager sync steps; outputs validate."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("jsonschema")
    from graphexec import SpeculativeConfig
    from test_structured_outputs import MODEL, _requests, check_output

    reqs = _requests(16, seed=8)
    params = [(rid, p, sp) for rid, p, sp, _ in reqs]
    opts = dict(device="cuda", dtype="float32", max_model_len=512, max_batch=8,
                max_num_batched_tokens=128, speculative=SpeculativeConfig("self:15", 3))
    eager = run_engine(Engine(MODEL, async_scheduling=False, cuda_graphs=False, **opts), params)
    engine = Engine(MODEL, async_scheduling=True, cuda_graphs=True, **opts)
    assert engine.runner.graphs.has(8, Variant(False, True, penalties=True, grammar=True))
    graphs = run_engine(engine, params)
    _same(eager, graphs)
    eos = engine.model_config.eos_token_ids[0]
    assert sum(check_output(graphs[rid], sp, c, eos) for rid, _, sp, c in reqs) >= 6
    constrained = [graphs[rid] for rid, _, _, c in reqs if c is not None]
    assert all(o.num_drafted_tokens == 0 for o in constrained)
