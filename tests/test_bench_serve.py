"""tools/bench_serve.py and tools/serve_workload.py: workloads, percentile math, the driver,
and small end-to-end runs on the tiny preset (CPU)."""
import json
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_serve  # noqa: E402
from serve_report import Percentiles, RequestTrace  # noqa: E402
from serve_workload import (LengthDist, WorkloadConfig, build_workloads,  # noqa: E402
                            offline_workload, online_workload, poisson_arrivals,
                            request_lengths, shared_prefix_workload)

from graphexec import Engine  # noqa: E402


def _as_tuples(workloads):
    return [(w.kind, w.rate, [(r.request_id, r.arrival_s, r.prompt_ids, r.output_len,
                               r.prompt_len, r.after) for r in w.requests]) for w in workloads]


# -- workloads ----------------------------------------------------------------------------------

def test_workloads_are_seeded_and_reproducible():
    cfg = WorkloadConfig(num_requests=30, seed=7, system_prompt_len=50)
    kinds = ["offline", "online", "shared-prefix"]
    a = build_workloads(cfg, kinds, [2.0, 8.0], vocab=500, max_len=2048)
    b = build_workloads(cfg, kinds, [2.0, 8.0], vocab=500, max_len=2048)
    assert _as_tuples(a) == _as_tuples(b)
    other = build_workloads(WorkloadConfig(num_requests=30, seed=8, system_prompt_len=50),
                            kinds, [2.0, 8.0], vocab=500, max_len=2048)
    assert _as_tuples(a) != _as_tuples(other)
    # every run of one engine gets fresh token ids over the same lengths
    off, on2, on8 = a[0].requests, a[1].requests, a[2].requests
    assert [r.prompt_len for r in off] == [r.prompt_len for r in on2]
    assert [r.output_len for r in off] == [r.output_len for r in on8]
    assert off[0].prompt_ids != on2[0].prompt_ids != on8[0].prompt_ids
    assert all(3 <= t < 500 for r in off for t in r.prompt_ids)


def test_length_distributions_have_the_asked_medians_and_clips():
    cfg = WorkloadConfig(num_requests=4000, seed=1)
    prompt, output = request_lengths(cfg, max_len=4096)
    assert abs(np.median(prompt) / 300 - 1) < 0.05
    assert abs(np.median(output) / 120 - 1) < 0.05
    assert prompt.min() >= 16 and prompt.max() <= 2048 and (prompt == 2048).any()
    assert output.min() >= 8 and output.max() <= 512 and (output == 512).any()
    fixed = WorkloadConfig(num_requests=100, fixed_prompt_len=16)
    assert set(request_lengths(fixed, 4096)[0].tolist()) == {16}
    # a short context shortens prompts so that prompt + output fits and outputs stay exact
    p, o = request_lengths(cfg, max_len=600)
    assert (p + o).max() <= 600 and (o == request_lengths(cfg, 4096)[1]).all()


def test_poisson_arrivals_scale_one_pattern_by_the_rate():
    cfg = WorkloadConfig(num_requests=4000, seed=3)
    a4, a16 = poisson_arrivals(cfg, 4.0), poisson_arrivals(cfg, 16.0)
    assert a4[0] == 0 and (np.diff(a4) >= 0).all()
    assert abs(np.mean(np.diff(a4)) * 4.0 - 1) < 0.05
    np.testing.assert_allclose(a4, a16 * 4)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(cfg, 0.0)
    wl = online_workload(cfg, vocab=100, max_len=4096, rate=4.0)
    assert [r.arrival_s for r in wl.requests] == a4.tolist()
    assert all(r.arrival_s == 0 for r in offline_workload(cfg, 100, 4096).requests)


def test_shared_prefix_conversations_grow_from_one_system_prompt():
    cfg = WorkloadConfig(num_requests=10, turns=3, system_prompt_len=40,
                         user=LengthDist(10, 0.5, 4, 20), output=LengthDist(12, 0.5, 8, 30))
    wl = shared_prefix_workload(cfg, vocab=300, max_len=150)
    reqs = {r.request_id: r for r in wl.requests}
    firsts = [r for r in wl.requests if r.after is None]
    assert len(firsts) == 4  # ceil(10 / 3) conversations
    assert len({tuple(r.prompt_ids[:40]) for r in firsts}) == 1
    assert len(wl.requests) <= 10
    for r in wl.requests:
        assert r.prompt_len + r.output_len <= 150
        if r.after is not None:
            prev = reqs[r.after]
            assert r.prompt_len == prev.prompt_len + prev.output_len + len(r.prompt_ids)
    with pytest.raises(ValueError, match="system_prompt_len"):
        shared_prefix_workload(WorkloadConfig(system_prompt_len=2000), 300, max_len=2010)


# -- metrics ------------------------------------------------------------------------------------

def test_percentiles_match_numpy():
    p = Percentiles.of(list(range(1, 101)))
    assert (p.p50, p.p90, p.p99, p.max, p.mean) == pytest.approx((50.5, 90.1, 99.01, 100, 50.5))
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 1000):
        x = rng.lognormal(size=n)
        p = Percentiles.of(x.tolist(), scale=1e3)
        want = np.percentile(x * 1e3, [50, 90, 99])
        assert [p.p50, p.p90, p.p99] == pytest.approx(want.tolist())
        assert p.max == pytest.approx(x.max() * 1e3) and p.p50 <= p.p99 <= p.max
    assert Percentiles.of([]) == Percentiles(None, None, None, None, None)


def test_inter_token_gaps_split_a_multi_token_step_evenly():
    tr = RequestTrace("r", arrival=0.25, prompt_len=5, asked=6)
    tr.on_tokens(1.0, 2)  # first step: prefill token + first decode token, no gap samples
    tr.on_tokens(1.5, 1)
    tr.on_tokens(1.5, 0)
    tr.on_tokens(2.5, 2)  # two tokens in one step (speculative): the gap split evenly
    assert tr.first_token == 1.0 and tr.tokens == 5
    assert tr.itl == pytest.approx([0.5, 0.5, 0.5])


def test_engine_options_are_parsed():
    assert bench_serve.parse_engine_option("max_num_batched_tokens=512") == (
        "max_num_batched_tokens", 512)
    assert bench_serve.parse_engine_option("dtype=bf16") == ("dtype", "bf16")
    assert bench_serve.parse_engine_option("cuda_graphs=false") == ("cuda_graphs", False)
    with pytest.raises(ValueError, match="key=value"):
        bench_serve.parse_engine_option("oops")
    spec = bench_serve.parse_speculative("self:4:2")
    assert (spec.draft, spec.num_tokens) == ("self:4", 2)
    for bad in ("self:4", "self", "4"):
        with pytest.raises(ValueError, match="DRAFT:K"):
            bench_serve.parse_speculative(bad)
    with pytest.raises(SystemExit, match="no_such_option"):
        bench_serve.build_engine("tiny", dict(no_such_option=1))


# -- end to end (tiny, CPU) ---------------------------------------------------------------------

SMALL = WorkloadConfig(num_requests=12, seed=5, prompt=LengthDist(24, 0.9, 16, 2048),
                       output=LengthDist(10, 0.7, 8, 512), system_prompt_len=48, turns=3)


@pytest.fixture
def one_thread():
    """One intra-op thread for the tiny engine: on a small CI machine busy with other processes,
    OpenMP threads that spin against theirs make steps many times slower, and the tiny model
    gains nothing from a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_driver_gives_every_request_its_length_and_builds_follow_up_prompts(async_scheduling,
                                                                            one_thread):
    with Engine("tiny", max_batch=8, device="cpu", async_scheduling=async_scheduling) as engine:
        for wl in build_workloads(SMALL, ["online", "shared-prefix"], [200.0],
                                  engine.model_config.vocab_size, engine.max_model_len):
            trace = bench_serve.drive(engine, wl)
            assert set(trace.requests) == {r.request_id for r in wl.requests}
            for spec in wl.requests:
                tr = trace.requests[spec.request_id]
                assert tr.tokens == spec.output_len and tr.finish is not None
                assert tr.prompt_len == spec.prompt_len  # previous prompt + output + new turn
                assert tr.arrival <= tr.first_token <= tr.finish
                assert len(tr.itl) >= spec.output_len - 2


def test_end_to_end_offline_and_online_on_tiny(tmp_path, one_thread):
    argv = ["--model", "tiny", "--num-requests", "12", "--kinds", "offline", "online",
            "--rates", "100", "--modes", "async", "sync", "--prompt-median", "24",
            "--output-median", "10", "--max-batch", "8", "--warmup", "2",
            "--engine-option", "device=cpu", "--out", str(tmp_path)]
    report = bench_serve.main(argv)
    files = sorted(os.listdir(tmp_path))
    assert {"serve_tiny.json", "serve_tiny.md", "serve_tiny_steps.json"} <= set(files)
    with open(tmp_path / "serve_tiny.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(report))
    meta = saved["meta"]
    assert {"command", "git_commit", "date", "device", "torch", "args", "engines",
            "workload"} <= meta.keys()
    assert meta["workload"]["output"]["median"] == 10
    assert meta["engines"]["async"]["options"]["async_scheduling"] is True
    runs = saved["runs"]
    assert [r["label"] for r in runs] == ["offline async", "online@100 async", "offline sync",
                                          "online@100 sync"]
    for r in runs:
        assert r["finished"] == r["num_requests"] == 12 and r["wrong_length"] == 0
        assert r["transport"] == "in-process" and r["incomplete"] == 0 and r["problems"] == []
        assert r["output_tokens"] > 12 * 7 and r["wall_s"] > 0 and r["output_tok_s"] > 0
        assert r["total_tok_s"] > r["output_tok_s"]
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_s"):
            p = r[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (key, p)
        assert r["steps"] > 0 and r["engine"]["steps"] == r["steps"]
        assert 0 < r["mean_batch"] <= 8
        assert r["mean_step_ms"] == pytest.approx(r["wall_s"] / r["steps"] * 1e3)
        assert r["gpu_busy_frac"] is None  # no CUDA timeline on the CPU
        assert r["ttft_ms"]["max"] <= r["latency_s"]["max"] * 1e3
    # outputs are exact, so both modes run the same token counts
    assert runs[0]["output_tokens"] == runs[2]["output_tokens"]
    assert runs[1]["arrival_span_s"] > 0 and runs[0]["arrival_span_s"] == 0
    with open(tmp_path / "serve_tiny_steps.json") as f:
        steps = json.load(f)
    assert len(steps["offline async"]["step_ms"]) == len(steps["offline async"]["t_s"]) > 0
    assert "| offline async | 12 |" in (tmp_path / "serve_tiny.md").read_text()
    assert saved["http_vs_in_process"] == []


def test_profile_serve_lists_where_the_time_went_on_tiny(tmp_path, one_thread):
    """tools/profile_serve.py on the CPU: both runs finish every request, and the table of
    op times by name is sorted and sums to its total."""
    import profile_serve

    res = profile_serve.main(["--model", "tiny", "--num-requests", "6", "--prompt-median", "24",
                              "--output-median", "8", "--warmup", "2", "--engine-option",
                              "device=cpu", "--engine-option", "max_batch=4", "--out",
                              str(tmp_path)])
    assert res["device"] == "cpu" and res["steps"] > 0 and res["unprofiled_steps"] > 0
    assert res["wall_s"] > 0 and res["unprofiled_wall_s"] > 0
    ms = [k["ms"] for k in res["kernels"]]
    assert ms and ms == sorted(ms, reverse=True)
    assert res["total_ms"] == pytest.approx(sum(ms))
    assert any("linear" in k["name"] or "mm" in k["name"] for k in res["kernels"])
    with open(tmp_path / "profile_serve_tiny.json") as f:
        assert json.load(f)["kernels"] == json.loads(json.dumps(res["kernels"]))
