"""Serving benchmark: `python tools/bench.py serve [options]` (or tools/bench_serve.py).

Drives one Engine per mode (async, sync) through seeded workloads (tools/serve_workload.py:
offline, online at each --rates, shared-prefix) from one thread: add every request whose arrival
time has passed, then Engine.step(); when the engine is idle, sleep until the next arrival.
Every request is greedy with ignore_eos, so output lengths are exact and both modes run the same
token counts.

Measured per run, from host timestamps taken when Engine.step returns:
- TTFT: from the request's scheduled arrival (not from when the loop got to add it: a late loop
  is latency the client sees) to the step that returned its first token. A follow-up turn of a
  conversation arrives when the previous turn's last token came back.
- ITL: the gap between consecutive steps that returned tokens for a request. A step that returns
  n tokens for a request after its first (speculative decoding) adds n samples of gap / n. The
  first step's extra tokens (under speculation a new row's prefill token and its first decode
  tokens come back together) add none: TTFT covers them.
- TPOT: per request, (finish - first token) / (output tokens - 1).
- GPU busy (CUDA): the time between the CUDA events around each step's forward (runner.timeline)
  over wall time. A step with prompt chunks runs them and the decode rows in one forward
  (capture/mixed.py), inside its events, so this is all the GPU's work; only a speculative
  engine runs its prefill before the iteration's start event, outside them.
- mean decode step time: wall / engine steps (prefill, host and idle time included).

With --http URL (a running `python -m graphexec.serve`) or --http auto (one started per mode
with the same engine options), the same requests also go through the server from concurrent
streaming clients (tools/bench_http.py); those rows are labelled "... http", timed from SSE
chunk arrivals, and compared with the in-process rows (output tok/s, HTTP / in-process). Every
request, either way, must come back complete with exactly its asked length: the command fails,
after writing the report, if one does not.

Writes serve_<model>.json (every number, the options, the command, commit, date, device),
serve_<model>.md (the table, also printed), serve_<model>_steps.json (per-step host wall time,
batch size, GPU time per iteration) and serve_<model>.png (latency against request rate for the
online runs, and the step-time timeline of one run); the report is tools/serve_report.py. An
auto-started server's output goes to serve_<model>_server_<mode>.log.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import heapq
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphexec import Engine, SamplingParams, SpeculativeConfig  # noqa: E402
from serve_report import (IncompleteRun, RequestTrace, RunResult, RunTrace,  # noqa: E402
                          StepSample, http_vs_in_process, markdown, plot, summarize)
from serve_workload import (LengthDist, RequestSpec, Workload, WorkloadConfig,  # noqa: E402
                            build_workloads)

KINDS = ("offline", "online", "shared-prefix")
MODES = {"async": True, "sync": False}


# -- the driver ---------------------------------------------------------------------------------

def _batch_sum(engine: Engine) -> int | None:
    stats = getattr(engine, "stats", None)
    return getattr(stats, "batch_size_sum", None)


def drive(engine: Engine, workload: Workload) -> RunTrace:
    """Runs one workload to completion; see the module docstring for the loop."""
    followers = {s.after: s for s in workload.requests if s.after is not None}
    due = [(s.arrival_s, i, s) for i, s in enumerate(workload.requests) if s.after is None]
    heapq.heapify(due)
    seq = len(workload.requests)
    prompts: dict[str, list[int]] = {}  # whole prompts of turns a follow-up will extend
    traces: dict[str, RequestTrace] = {}
    steps: list[StepSample] = []
    drafted = accepted = 0
    t0 = time.perf_counter()
    while due or engine.has_unfinished():
        now = time.perf_counter() - t0
        while due and due[0][0] <= now:
            arrival, _, spec = heapq.heappop(due)
            prompt = _submit(engine, spec, prompts)
            if spec.request_id in followers:
                prompts[spec.request_id] = prompt
            traces[spec.request_id] = RequestTrace(spec.request_id, arrival, len(prompt),
                                                   spec.output_len)
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[0][0] - (time.perf_counter() - t0)))
            continue
        before, s = _batch_sum(engine), time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        after = _batch_sum(engine)
        t = e - t0
        new = 0
        for out in outs:
            tr = traces[out.request_id]
            tr.on_tokens(t, len(out.new_token_ids))
            new += len(out.new_token_ids)
            if not out.finished:
                continue
            tr.finish = t
            drafted += out.num_drafted_tokens
            accepted += out.num_accepted_tokens
            nxt = followers.get(out.request_id)
            if nxt is not None:
                prompts[out.request_id] = prompts[out.request_id] + out.token_ids
                heapq.heappush(due, (t, seq, nxt))
                seq += 1
        steps.append(StepSample(t, e - s, new, None if before is None else after - before))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return RunTrace(traces, steps, time.perf_counter() - t0, drafted, accepted)


def _submit(engine: Engine, spec: RequestSpec, prompts: dict[str, list[int]]) -> list[int]:
    prompt = spec.prompt_ids
    if spec.after is not None:
        prompt = prompts.pop(spec.after) + prompt
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    engine.add_request(spec.request_id, prompt, params)
    return prompt



# -- engines ------------------------------------------------------------------------------------

def engine_options(args: argparse.Namespace, mode: str) -> dict:
    opts = dict(parse_engine_option(o) for o in args.engine_option)
    opts["async_scheduling"] = MODES[mode]
    if args.max_batch is not None:
        opts["max_batch"] = args.max_batch
    if args.num_kv_blocks is not None:
        opts["num_kv_blocks"] = args.num_kv_blocks
    if args.speculative is not None:
        opts["speculative"] = parse_speculative(args.speculative)
    if args.prefix_caching is not None:  # only when asked: the option may not exist yet
        opts["enable_prefix_caching"] = args.prefix_caching == "on"
    return opts


def parse_engine_option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"--engine-option {text!r}: expected key=value")
    words = {"true": True, "false": False, "none": None}
    if raw.lower() in words:
        return key, words[raw.lower()]
    try:
        return key, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw  # a plain string, e.g. dtype=bf16


def parse_speculative(text: str) -> SpeculativeConfig:
    """"self:N:K" (or "<draft>:K"): the draft, then K tokens drafted a step."""
    draft, sep, k = text.rpartition(":")
    # "self:4" alone would read as draft "self" with K = 4: ask for both
    if not sep or not draft or draft == "self" or not k.isdigit():
        raise ValueError(f"--speculative {text!r}: expected DRAFT:K, e.g. self:4:4")
    return SpeculativeConfig(draft=draft, num_tokens=int(k))


def build_engine(model: str, options: dict) -> Engine:
    try:
        return Engine(model, **options)
    except TypeError as e:
        if "unexpected keyword" not in str(e):
            raise
        raise SystemExit(f"Engine rejected an option ({e}); this graphexec does not have it. "
                         f"Options passed: {sorted(options)}") from e


WARMUP_TOKENS = 6  # output tokens of each warm-up request


def warmup_prompts(vocab: int, max_len: int, kv_tokens: int,
                   num: int) -> list[list[list[int]]]:
    """Short requests of a few prompt lengths: `num` together, then one alone, so that JIT
    compiles and first launches happen before any timed run (graphs are captured when the
    engine is built). Both drivers send these same prompts."""
    # a small KV cache (--num-kv-blocks) must still hold each warm-up request alone
    longest = max(16, min(max_len, kv_tokens // 2) - 16)
    rng = np.random.default_rng(12345)
    lengths = [min(n, longest) for n in (16, 50, 200, 700, 33, 120, 400, 1500)]
    batches = [[lengths[i % len(lengths)] for i in range(num)], [lengths[0]]]
    return [[rng.integers(3, vocab, size=n).tolist() for n in batch] for batch in batches]


def warm_up(engine: Engine, num: int) -> None:
    kv_tokens = engine.stats_summary()["kv_total"] * engine.config.block_size
    batches = warmup_prompts(engine.model_config.vocab_size, engine.max_model_len, kv_tokens,
                             num)
    for b, batch in enumerate(batches):
        for i, ids in enumerate(batch):
            engine.add_request(f"warmup-{b}-{i}", ids, SamplingParams(
                max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()


def triton_cache_entries() -> int:
    """Files in Triton's on-disk cache: growth during a timed run means a JIT compile in it."""
    root = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    return sum(len(f) for _, _, f in os.walk(root)) if os.path.isdir(root) else 0


def run_one(engine: Engine, workload: Workload, mode: str) -> tuple[RunResult, dict]:
    """Times one workload; returns its result and its per-step series."""
    cuda = engine.config.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        engine.runner.timeline = []
    compiled, before = triton_cache_entries(), engine.stats_summary()
    trace = drive(engine, workload)
    after = engine.stats_summary()
    gpu_ms, prefill = None, None
    if cuda:
        timeline, engine.runner.timeline = engine.runner.timeline, None
        gpu_ms = [s.elapsed_time(e) for s, e, _ in timeline]
        prefill = [bool(p) for _, _, p in timeline]
    res = summarize(workload, mode, trace, before, after, gpu_ms,
                    triton_cache_entries() - compiled)
    series = dict(t_s=[s.t for s in trace.steps], step_ms=[s.wall * 1e3 for s in trace.steps],
                  tokens=[s.tokens for s in trace.steps], batch=[s.batch for s in trace.steps],
                  gpu_iter_ms=gpu_ms, gpu_iter_prefill=prefill)
    return res, series


def run_mode(args: argparse.Namespace, mode: str, cfg: WorkloadConfig,
             ) -> tuple[list[RunResult], dict, dict]:
    options = engine_options(args, mode)
    engine = build_engine(args.model, options)
    try:
        warm_up(engine, args.warmup)
        workloads = build_workloads(cfg, args.kinds, args.rates, engine.model_config.vocab_size,
                                    engine.max_model_len)
        results, series = [], {}
        for wl in workloads:
            res, steps = run_one(engine, wl, mode)
            print(json.dumps(row_brief(res)), flush=True)
            results.append(res)
            series[res.label] = steps
        info = dict(max_batch=engine.config.max_batch, max_model_len=engine.max_model_len,
                    kv_blocks=engine.stats_summary().get("kv_total"),
                    vocab_size=engine.model_config.vocab_size,
                    options={k: repr(v) if k == "speculative" else v for k, v in options.items()})
        return results, series, info
    finally:
        engine.close()


def row_brief(r: RunResult) -> dict:
    return dict(run=r.label, wall_s=round(r.wall_s, 3), out_tok_s=round(r.output_tok_s, 1),
                ttft_p50_ms=r.ttft_ms.p50, itl_p50_ms=r.itl_ms.p50, steps=r.steps)


# -- command line -------------------------------------------------------------------------------

def metadata(args: argparse.Namespace, argv: list[str]) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cuda = torch.cuda.is_available()
    return dict(command="python tools/bench.py serve " + " ".join(argv),
                git_commit=_git(root, "rev-parse", "--short", "HEAD"),
                git_dirty=bool(_git(root, "status", "--porcelain", "--untracked-files=no")),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()})",
                torch=torch.__version__, python=platform.python_version(), model=args.model,
                args=vars(args))


def _git(root: str, *cmd: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tools/bench.py serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b", help="preset name or model directory")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", nargs="+", default=["offline", "online"], choices=KINDS)
    ap.add_argument("--rates", nargs="+", type=float, default=[4.0, 16.0, 32.0],
                    help="online: requests/s, one run each")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="every prompt this long (offline/online) instead of lognormal")
    ap.add_argument("--prompt-median", type=float, default=300)
    ap.add_argument("--output-median", type=float, default=120)
    ap.add_argument("--system-prompt-len", type=int, default=2000, help="shared-prefix")
    ap.add_argument("--turns", type=int, default=4, help="shared-prefix: turns a conversation")
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--speculative", default=None, help="DRAFT:K, e.g. self:4:4")
    ap.add_argument("--prefix-caching", choices=["on", "off"], default=None,
                    help="pass enable_prefix_caching to Engine (only when given)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to Engine, repeatable (values parsed as Python literals)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests per engine")
    ap.add_argument("--http", default=None, metavar="URL|auto",
                    help="also send the requests through a server: the URL of a running "
                         "`python -m graphexec.serve`, or auto to start one per mode with the "
                         "in-process engine's options (tools/bench_http.py)")
    ap.add_argument("--data-parallel-size", nargs="+", type=int, default=[1],
                    help="--http auto: a server per value, with that many engine replicas")
    ap.add_argument("--data-parallel-routing", nargs="+", default=[None],
                    choices=["prefix", "load"],
                    help="--http auto with replicas: a server per routing policy")
    ap.add_argument("--http-only", action="store_true",
                    help="with --http: skip the in-process runs")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="--http: streams open at once (default: no limit for offline and "
                         "shared-prefix, as in-process; 2 x max_batch for online)")
    ap.add_argument("--client-procs", type=int, default=4,
                    help="--http: client processes the streams are spread over (one asyncio "
                         "process cannot read ten thousand SSE chunks a second)")
    ap.add_argument("--server-timeout", type=float, default=900.0,
                    help="--http auto: seconds the server may take to answer /health")
    ap.add_argument("--out", default="out")
    ap.add_argument("--docs", default=None, help="also append the tables to this file")
    return ap.parse_args(argv)


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    base = WorkloadConfig()
    return WorkloadConfig(
        num_requests=args.num_requests, seed=args.seed,
        prompt=LengthDist(args.prompt_median, base.prompt.sigma, base.prompt.low,
                          base.prompt.high),
        output=LengthDist(args.output_median, base.output.sigma, base.output.low,
                          base.output.high),
        fixed_prompt_len=args.prompt_len, system_prompt_len=args.system_prompt_len,
        turns=args.turns)


def check_args(args: argparse.Namespace) -> None:
    if args.http is not None and args.http != "auto" and not args.http.startswith(
            ("http://", "https://")):
        raise ValueError(f"--http {args.http!r}: expected a URL (http://host:port) or auto")
    if args.http_only and args.http is None:
        raise ValueError("--http-only needs --http URL or --http auto")
    if args.http not in (None, "auto") and len(args.modes) != 1:
        raise ValueError(f"--http {args.http}: a running server has one scheduling mode; "
                         f"give it as the one --modes (got {args.modes})")
    if (max(args.data_parallel_size) > 1 or args.data_parallel_routing != [None]) and (
            args.http != "auto"):
        raise ValueError("--data-parallel-size / --data-parallel-routing start servers of "
                         "their own: they need --http auto")
    if args.client_procs < 1:
        raise ValueError(f"--client-procs must be >= 1, got {args.client_procs}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = workload_config(args)
        for o in args.engine_option:
            parse_engine_option(o)
        if args.speculative is not None:
            parse_speculative(args.speculative)
        check_args(args)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.http is not None:
        import bench_http  # only here: it needs httpx, which in-process runs do not
    os.makedirs(args.out, exist_ok=True)
    meta = metadata(args, argv)
    results, series, engines, servers = [], {}, {}, {}
    for mode in args.modes:
        if not args.http_only:
            res, steps, engines[mode] = run_mode(args, mode, cfg)
            results += res
            series.update(steps)
        if args.http is None:
            continue
        for replicas in args.data_parallel_size:
            # one replica routes nowhere: one run whatever the policies
            for routing in args.data_parallel_routing if replicas > 1 else [None]:
                res, steps, info = bench_http.run_mode(args, mode, cfg, engines.get(mode),
                                                       replicas, routing)
                key = [mode] + ([f"dp{replicas}"] if replicas > 1 else []) + (
                    [routing] if routing else [])
                servers[" ".join(key)] = info
                results += res
                series.update(steps)
    meta["engines"] = engines
    if servers:
        meta["servers"] = servers
    meta["workload"] = asdict(cfg)  # the length distributions, clips and seed behind the runs
    report = dict(meta=meta, runs=[asdict(r) for r in results],
                  http_vs_in_process=http_vs_in_process(results))
    report = _write(args, report, results, series)
    fail_if_incomplete(results)
    return report


def fail_if_incomplete(results: list[RunResult]) -> None:
    """After the report is written (it holds the details): a lost request fails the command."""
    bad = [r for r in results if r.incomplete]
    if not bad:
        return
    lines = [f"{r.label}: {r.incomplete} of {r.num_requests} requests did not come back whole, "
             f"e.g. {'; '.join(r.problems[:3])}" for r in bad]
    raise IncompleteRun("\n".join(lines))


def _write(args: argparse.Namespace, report: dict, results: list[RunResult],
           series: dict) -> dict:
    stem = os.path.join(args.out, "serve_" + os.path.basename(os.path.normpath(args.model)))
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(stem + "_steps.json", "w") as f:
        json.dump(series, f)
    md = markdown(results, report["meta"])
    with open(stem + ".md", "w") as f:
        f.write(md + "\n")
    if args.docs is not None:
        with open(args.docs, "a") as f:
            f.write(f"\n### Serving: `tools/bench.py serve` ({args.model}), "
                    f"{datetime.date.today().isoformat()}\n\n{md}\n")
    plot(results, series, stem + ".png")
    print(md)
    return report


if __name__ == "__main__":
    main()
