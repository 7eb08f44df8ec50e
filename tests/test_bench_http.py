"""tools/bench_http.py: the serving benchmark through `python -m graphexec.serve`. SSE parsing and
the completeness check on hand-made traces, then real server processes on the tiny preset (CPU):
the driver alone, `--http URL --http-only`, and `--http auto` beside the in-process runs."""
import asyncio
import json
import os
import re
import sys

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_http  # noqa: E402
import serve_process  # noqa: E402
import bench_serve  # noqa: E402
import httpx  # noqa: E402
from bench_http import HttpTrace  # noqa: E402
from serve_report import (IncompleteRun, RunTrace, incomplete_requests,  # noqa: E402
                          summarize)
from serve_workload import (LengthDist, RequestSpec, Workload, WorkloadConfig,  # noqa: E402
                            build_workloads)

from graphexec import SpeculativeConfig  # noqa: E402

SMALL = WorkloadConfig(num_requests=12, seed=5, prompt=LengthDist(24, 0.9, 16, 2048),
                       output=LengthDist(10, 0.7, 8, 512), system_prompt_len=48, turns=3)
MAX_BATCH = 8


def _chunk(ids, finish=None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": "", "token_ids": ids,
                                    "finish_reason": finish}]})


def _usage(n: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                "total_tokens": 4 + n}})


def _whole(request_id: str = "r", asked: int = 4) -> HttpTrace:
    tr = HttpTrace(request_id, arrival=0.0, prompt_len=4, asked=asked, status=200)
    for t, data in ((0.1, _chunk([5, 6])), (0.2, _chunk([7])), (0.4, _chunk([8], "length")),
                    (0.4, _usage(4)), (0.4, "[DONE]")):
        tr.on_event(data, t)
    return tr


# -- traces and the completeness check ----------------------------------------------------------

def test_sse_chunks_give_tokens_ttft_and_gaps():
    tr = _whole()
    assert tr.problem() is None
    assert (tr.first_token, tr.finish, tr.tokens, tr.usage_tokens) == (0.1, 0.4, 4, 4)
    assert tr.itl == pytest.approx([0.1, 0.2])  # the first chunk's two tokens add no gap
    # a server that ignores return_token_ids: a chunk of text counts as one token
    bare = HttpTrace("b", 0.0, 4, 1)
    bare.on_event(json.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}),
                  0.1)
    assert bare.tokens == 1


@pytest.mark.parametrize("events, why", [
    ([_chunk([5, 6]), _chunk([7])], "never finished"),  # cut mid-stream
    ([_chunk([5, 6]), _chunk([7], "length"), _usage(3), "[DONE]"], "3 tokens, asked for 4"),
    ([_chunk([5, 6]), _chunk([7, 8], "length"), _usage(4)], "without \\[DONE\\]"),
    ([_chunk([5, 6]), _chunk([7, 8], "length"), "[DONE]"], "usage says None"),
    ([_chunk([5, 6]), _chunk([7, 8], "stop"), _usage(4), "[DONE]"], "finish_reason 'stop'"),
    ([_chunk([5]), json.dumps({"error": {"message": "the server is shutting down"}}), "[DONE]"],
     "shutting down"),
])
def test_a_cut_or_short_stream_is_a_problem(events, why):
    tr = HttpTrace("r", 0.0, 4, 4, status=200)
    for i, data in enumerate(events):
        tr.on_event(data, 0.1 * (i + 1))
    problem = tr.problem()
    assert problem is not None and re.search(why, problem), problem


def test_lost_requests_fail_the_run_loudly():
    specs = [RequestSpec(f"offline-{i}", 0.0, [5, 6, 7, 8], 4, 4) for i in range(3)]
    wl = Workload("offline", None, specs)
    whole = {s.request_id: _whole(s.request_id) for s in specs}
    assert incomplete_requests(wl, whole) == []
    # a truncated trace: one request cut after two chunks, one never sent
    cut = HttpTrace("offline-1", 0.0, 4, 4, status=200)
    cut.on_event(_chunk([5, 6]), 0.1)
    cut.on_event(_chunk([7]), 0.2)
    traces = {"offline-0": whole["offline-0"], "offline-1": cut}
    problems = incomplete_requests(wl, traces)
    assert problems == ["offline-1: never finished (3 of 4 tokens)", "offline-2: never sent"]
    res = summarize(wl, "async", RunTrace(traces, [], 1.0), {}, {}, None, 0, transport="http")
    assert (res.label, res.incomplete, res.finished, res.problems) == (
        "offline async http", 2, 1, problems)
    with pytest.raises(IncompleteRun, match="offline async http: 2 of 3 requests"):
        bench_serve.fail_if_incomplete([res])
    ok = summarize(wl, "async", RunTrace(whole, [], 1.0), {}, {}, None, 0, transport="http")
    bench_serve.fail_if_incomplete([ok])  # nothing lost: no error


# -- the server command -------------------------------------------------------------------------

def test_server_argv_carries_the_engine_options():
    opts = dict(async_scheduling=False, device="cpu", max_batch=8, num_kv_blocks=100,
                max_num_batched_tokens=256, cuda_graphs=False, dtype="bf16",
                speculative=SpeculativeConfig("self:2", 3), seed=None)
    argv = serve_process.server_argv("tiny", opts, 1234, 300)
    text = " ".join(argv[1:])
    assert text.startswith("-m graphexec.serve --model tiny --host 127.0.0.1 --port 1234 "
                           "--max-queue 300")
    for flags in ("--sync", "--device cpu", "--max-batch 8", "--num-kv-blocks 100",
                  "--max-num-batched-tokens 256", "--no-cuda-graphs", "--dtype bf16",
                  "--speculative-draft self:2 --num-speculative-tokens 3"):
        assert flags in text
    assert "--seed" not in text
    make_argv = serve_process.server_argv
    assert "--sync" not in " ".join(make_argv("tiny", dict(async_scheduling=True), 1, 1))
    assert make_argv("tiny", dict(enable_prefix_caching=False), 1, 1)[-1] == "warning"
    assert "--enable-prefix-caching" in serve_process.server_argv(
        "tiny", dict(enable_prefix_caching=True), 1, 1)
    with pytest.raises(ValueError, match="use_triton"):  # no server flag
        serve_process.server_argv("tiny", {"use_triton": True}, 1, 1)


def test_the_server_gets_the_in_process_engine_sizes():
    args = bench_serve.parse_args(["--model", "tiny", "--engine-option", "device=cpu",
                                   "--engine-option", "kv_cache_memory=1000000", "--http", "auto"])
    engine = dict(max_batch=8, kv_blocks=77, max_model_len=512, vocab_size=300)
    opts = serve_process.server_options(args, "sync", engine)
    assert opts == dict(device="cpu", async_scheduling=False, max_batch=8, num_kv_blocks=77,
                        max_model_len=512)


def test_bad_http_arguments_are_refused():
    for argv, why in ((["--http", "localhost:8000"], "expected a URL"),
                      (["--http-only"], "needs --http"),
                      (["--http", "http://127.0.0.1:1", "--modes", "async", "sync"],
                       "one scheduling mode"),
                      (["--http", "auto", "--concurrency", "0"], "concurrency")):
        with pytest.raises(SystemExit, match=why):
            bench_serve.main(["--model", "tiny", *argv])


# -- against real servers (tiny, CPU) -----------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = serve_process.free_port()
    argv = serve_process.server_argv("tiny", dict(device="cpu", max_batch=MAX_BATCH), port, 256)
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # see one_thread
        proc = serve_process.ServerProcess(argv, port, log)
    with proc:
        proc.wait_healthy(120)
        yield proc
    assert proc.exit_code == 0, proc.log_tail()


@pytest.fixture
def one_thread(monkeypatch):
    """One intra-op thread for the test's engine and the servers it starts: on a small, busy
    CI machine, processes whose OpenMP threads spin against each other make steps many times
    slower, and the tiny model gains nothing from a second thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _drive(url: str, workloads: list[Workload], concurrency: int | None) -> list[RunTrace]:
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return [await bench_http.drive(client, "tiny", wl, concurrency) for wl in workloads]
    return asyncio.run(go())


def test_driver_gives_every_request_its_exact_length(server):
    workloads = build_workloads(SMALL, ["offline", "online", "shared-prefix"], [200.0],
                                vocab=bench_http.model_vocab("tiny"), max_len=2048)
    for wl, trace in zip(workloads, _drive(server.url, workloads, concurrency=3)):
        assert incomplete_requests(wl, trace.requests) == [], wl.label
        for spec in wl.requests:
            tr = trace.requests[spec.request_id]
            assert tr.tokens == tr.usage_tokens == spec.output_len and tr.done
            assert tr.prompt_len == spec.prompt_len  # follow-ups: previous prompt + output + new
            assert tr.arrival <= tr.first_token <= tr.finish
            # a stream that fell behind gets several steps' tokens in one chunk
            assert len(tr.itl) == spec.output_len - tr.first_chunk_tokens
        if wl.kind == "online":
            assert max(t.arrival for t in trace.requests.values()) > 0


def test_conversations_stay_whole_when_split_over_client_processes():
    wl = build_workloads(SMALL, ["shared-prefix"], [], vocab=bench_http.model_vocab("tiny"),
                         max_len=2048)[0]
    parts = bench_http.split_workload(wl, 3)
    assert sorted(s.request_id for p in parts for s in p.requests) == sorted(
        s.request_id for s in wl.requests)
    for part in parts:
        ids = {s.request_id for s in part.requests}
        assert all(s.after is None or s.after in ids for s in part.requests)
    assert len(parts) == 3 and all(p.kind == wl.kind for p in parts)


def test_client_processes_give_every_request_its_exact_length(server):
    workloads = build_workloads(SMALL, ["offline", "shared-prefix"], [],
                                vocab=bench_http.model_vocab("tiny"), max_len=2048)
    pool = bench_http.ClientPool(2)
    try:
        for wl in workloads:
            trace = pool.drive(server.url, "tiny", wl, None)
            assert incomplete_requests(wl, trace.requests) == [], wl.label
            assert set(trace.requests) == {s.request_id for s in wl.requests}
            assert max(t.finish for t in trace.requests.values()) <= trace.wall
    finally:
        pool.close()


def test_a_request_the_server_refuses_is_reported_lost(server):
    ok = RequestSpec("ok", 0.0, [5, 6, 7, 8], 5, 4)
    too_long = RequestSpec("too-long", 0.0, [5, 6, 7, 8], 5000, 4)  # past the 2048 context
    wl = Workload("offline", None, [ok, too_long])
    (trace,) = _drive(server.url, [wl], None)
    problems = incomplete_requests(wl, trace.requests)
    assert len(problems) == 1, problems
    assert problems[0].startswith("too-long: HTTP 400: max_tokens=5000"), problems


def test_http_only_against_a_running_server(server, tmp_path):
    argv = ["--model", "tiny", "--num-requests", "12", "--kinds", "offline", "--modes", "async",
            "--prompt-median", "24", "--output-median", "10", "--warmup", "2",
            "--http", server.url, "--http-only", "--out", str(tmp_path)]
    report = bench_serve.main(argv)
    (run,) = report["runs"]
    assert run["label"] == "offline async http" and run["incomplete"] == 0
    assert report["meta"]["servers"]["async"]["url"] == server.url
    assert report["http_vs_in_process"] == []


def test_in_process_and_http_auto_in_one_invocation(tmp_path, one_thread):
    argv = ["--model", "tiny", "--num-requests", "12", "--kinds", "offline", "online",
            "--rates", "100", "--modes", "async", "--prompt-median", "24",
            "--output-median", "10", "--max-batch", str(MAX_BATCH), "--warmup", "2",
            "--engine-option", "device=cpu", "--engine-option", "max_num_batched_tokens=128",
            "--http", "auto", "--out", str(tmp_path)]
    report = bench_serve.main(argv)
    with open(tmp_path / "serve_tiny.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(report))
    runs = {r["label"]: r for r in saved["runs"]}
    assert list(runs) == ["offline async", "online@100 async", "offline async http",
                          "online@100 async http"]
    for label, r in runs.items():
        assert r["transport"] == ("http" if label.endswith("http") else "in-process")
        assert r["finished"] == r["num_requests"] == 12
        assert r["incomplete"] == r["wrong_length"] == 0 and r["problems"] == []
        assert r["wall_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "latency_s"):
            p = r[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (label, key, p)
        assert r["ttft_ms"]["max"] <= r["latency_s"]["max"] * 1e3
        assert r["steps"] > 0 and r["engine"]["steps"] == r["steps"]
    for kind in ("offline", "online@100"):  # the same requests both ways
        local, http = runs[f"{kind} async"], runs[f"{kind} async http"]
        for key in ("output_tokens", "prompt_tokens", "arrival_span_s"):
            assert local[key] == pytest.approx(http[key]), key
        assert http["engine"]["tokens"] == http["output_tokens"]
    assert runs["online@100 async http"]["arrival_span_s"] > 0
    server = saved["meta"]["servers"]["async"]
    engine = saved["meta"]["engines"]["async"]
    assert server["exit_code"] == 0 and server["kv_blocks"] == engine["kv_blocks"]
    assert server["max_model_len"] == engine["max_model_len"] and server["max_batch"] == 8
    assert "--max-num-batched-tokens 128" in " ".join(server["argv"])
    assert server["concurrency"] == {"offline async http": None,
                                     "online@100 async http": 2 * MAX_BATCH}
    pairs = saved["http_vs_in_process"]
    assert [p["run"] for p in pairs] == ["offline async", "online@100 async"]
    for p in pairs:
        assert p["out_tok_s_ratio"] == pytest.approx(p["http_out_tok_s"] /
                                                     p["in_process_out_tok_s"])
        assert p["out_tok_s_ratio"] > 0  # its size is the measurement, not a property
    md = (tmp_path / "serve_tiny.md").read_text()
    assert "| offline async http | 12 |" in md and "HTTP / in-process" in md
