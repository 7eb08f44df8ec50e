"""The serving benchmark over HTTP: `python tools/bench.py serve --http URL|auto` (see
tools/bench_serve.py for the workloads, the metrics and the report, which both drivers share).

The seeded requests of the in-process runs go to a `python -m graphexec.serve` as streaming
/v1/completions calls (token-id prompts, greedy, ignore_eos), one asyncio task each on an
httpx.AsyncClient in one of --client-procs processes (whole conversations per process, the
same clock origin in all): offline all at t = 0, online at their Poisson arrival times, a
shared-prefix follow-up turn when the previous turn's last chunk came. --http auto starts one
server per mode with the in-process engine's options (max_batch, KV blocks and context length
copied from the engine the in-process run built, so both runs have the same engine;
tools/serve_process.py) and SIGTERMs it after.

Timing is the client's: a request's tokens count at the moment its SSE chunk is read (TTFT from
its scheduled arrival, so time spent waiting for a --concurrency slot counts), tokens per chunk
from `token_ids` (return_token_ids). A request is whole when the stream answered 200, ended
with finish_reason "length" and [DONE], carried exactly max_tokens token ids and its usage chunk
says the same; anything else is listed as lost (serve_report.incomplete_requests).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import multiprocessing as mp
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import (WARMUP_TOKENS, engine_options, row_brief,  # noqa: E402
                         triton_cache_entries, warmup_prompts)
from serve_report import IncompleteRun, RequestTrace, RunResult, RunTrace, summarize  # noqa: E402
from serve_process import ServerProcess, free_port, server_argv, server_options  # noqa: E402
from serve_workload import RequestSpec, Workload, WorkloadConfig, build_workloads  # noqa: E402

DEFAULT_MAX_BATCH = 64  # EngineConfig's, for a server whose options we were not told
DEFAULT_BLOCK_SIZE = 16
# /metrics series -> the stats_summary() keys the report reads (serve_report.engine_counters)
METRICS = {"graphexec_engine_steps_total": "steps", "graphexec_engine_pauses_total": "pauses",
           "graphexec_engine_evictions_total": "evictions",
           "graphexec_engine_chain_breaks_total": "chain_breaks",
           "graphexec_generation_tokens_total": "tokens",
           "graphexec_kv_blocks_total": "kv_total", "graphexec_kv_blocks_used": "kv_used",
           "graphexec_prefix_query_tokens_total": "prefix_query_tokens",
           "graphexec_prefix_hit_tokens_total": "prefix_hit_tokens"}


# No pool limit and no read timeout: offline opens every stream at once, and a request queued
# behind hundreds of others may wait minutes for its first chunk.
_NO_POOL_LIMIT = httpx.Limits(max_connections=None, max_keepalive_connections=None)
_NO_READ_TIMEOUT = httpx.Timeout(None, connect=60.0)


# -- one streamed request -----------------------------------------------------------------------

@dataclass
class HttpTrace(RequestTrace):
    """A RequestTrace filled from SSE chunks, with what the stream said about its own end."""

    status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done: bool = False  # [DONE] came
    token_ids: list[int] = field(default_factory=list)  # kept for follow-up turns only
    keep_ids: bool = False

    def on_event(self, data: str, t: float) -> None:
        """One SSE `data:` payload read at t."""
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if "error" in obj:  # the server's error event: the stream ends after it
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        if obj.get("usage"):
            self.usage_tokens = obj["usage"]["completion_tokens"]
        for choice in obj.get("choices", []):
            ids = choice.get("token_ids")
            # without token ids (a server that ignores return_token_ids), a chunk of text is
            # one token; the usage chunk then still checks the total
            n = len(ids) if ids is not None else int(bool(choice.get("text")))
            self.on_tokens(t, n)
            if self.keep_ids and ids:
                self.token_ids += ids
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.finish = t

    def problem(self) -> str | None:
        rid = self.request_id
        if self.error is not None:
            full = self.status == 503 and "max_queue" in self.error  # the server's queue
            hint = "; --concurrency N keeps fewer streams open" if full else ""
            return f"{rid}: HTTP {self.status}: {self.error}{hint}"
        if self.finish is not None and self.finish_reason != "length":
            return f"{rid}: finish_reason {self.finish_reason!r}, expected 'length'"
        base = super().problem()
        if base is not None:
            return base
        if not self.done:
            return f"{rid}: the stream ended without [DONE]"
        if self.usage_tokens != self.asked:
            return f"{rid}: usage says {self.usage_tokens} completion tokens, asked {self.asked}"
        return None


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int],
                            trace: HttpTrace, clock: Callable[[], float]) -> None:
    """Sends one request and fills `trace` from its stream; never raises for what the server
    or the connection does (that goes in trace.error, for the completeness check)."""
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(model, prompt, trace.asked)) as resp:
            trace.status = resp.status_code
            if resp.status_code != 200:
                trace.error = error_message(await resp.aread())
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    trace.on_event(line[6:], clock())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        trace.error = f"{type(e).__name__}: {e}"


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300]


# -- a workload ---------------------------------------------------------------------------------

async def drive(client: httpx.AsyncClient, model: str, workload: Workload,
                concurrency: int | None, t0: float | None = None) -> RunTrace:
    """Runs one workload to completion, one task per request (see the module docstring).
    t0: the perf_counter reading the arrivals count from (default: now)."""
    followers = {s.after: s for s in workload.requests if s.after is not None}
    traces: dict[str, HttpTrace] = {}
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    tasks: set[asyncio.Task] = set()
    t0 = time.perf_counter() if t0 is None else t0

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(spec: RequestSpec, arrival: float, prompt: list[int]) -> None:
        await asyncio.sleep(arrival - clock())
        tr = HttpTrace(spec.request_id, arrival, len(prompt), spec.output_len,
                       keep_ids=spec.request_id in followers)
        traces[spec.request_id] = tr
        async with gate or contextlib.nullcontext():
            await stream_completion(client, model, prompt, tr, clock)
        nxt = followers.get(spec.request_id)
        if nxt is not None and tr.problem() is None:  # else the follower is lost too
            launch(nxt, tr.finish, prompt + tr.token_ids + nxt.prompt_ids)

    def launch(spec: RequestSpec, arrival: float, prompt: list[int]) -> None:
        tasks.add(asyncio.create_task(one(spec, arrival, prompt)))

    for spec in workload.requests:
        if spec.after is None:
            launch(spec, spec.arrival_s, spec.prompt_ids)
    while tasks:  # follow-up turns join the set while it is awaited
        done, _ = await asyncio.wait(set(tasks))
        tasks -= done
        for task in done:
            task.result()  # a bug in the driver itself surfaces here
    return RunTrace(dict(traces), [], clock())


def split_workload(workload: Workload, parts: int) -> list[Workload]:
    """The requests dealt to `parts` client processes, whole conversations at a time (a
    follow-up turn is sent by the process that saw the turn before it end)."""
    by_id = {s.request_id: s for s in workload.requests}

    def first_turn(spec: RequestSpec) -> str:
        while spec.after is not None:
            spec = by_id[spec.after]
        return spec.request_id

    deal: dict[str, int] = {}
    out = [Workload(workload.kind, workload.rate) for _ in range(parts)]
    for spec in workload.requests:
        part = deal.setdefault(first_turn(spec), len(deal) % parts)
        out[part].requests.append(spec)
    return [wl for wl in out if wl.requests]


def _drive_part(url: str, model: str, workload: Workload, concurrency: int | None,
                t0: float) -> RunTrace:
    """One client process's share (a spawn target)."""
    async def go() -> RunTrace:
        async with httpx.AsyncClient(base_url=url, limits=_NO_POOL_LIMIT,
                                     timeout=_NO_READ_TIMEOUT) as client:
            return await drive(client, model, workload, concurrency, t0)
    return asyncio.run(go())


def _ready() -> None:
    """Run once in each client process before a workload's clock starts: its start-up
    (interpreter, imports) must not count as the server's latency."""


class ClientPool:
    """Client processes that send one workload together. One asyncio process reading a few
    hundred streams at ten thousand chunks a second is itself the bottleneck (httpx parses
    every SSE line in Python), so the streams are spread over several, as load generators do."""

    def __init__(self, procs: int):
        self.procs = procs
        self._pool = ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"))
        for f in [self._pool.submit(_ready) for _ in range(procs)]:
            f.result()

    def drive(self, url: str, model: str, workload: Workload,
              concurrency: int | None) -> RunTrace:
        parts = split_workload(workload, self.procs)
        share = None if concurrency is None else -(-concurrency // len(parts))
        t0 = time.perf_counter() + 0.05  # the same origin in every process (CLOCK_MONOTONIC)
        futures = [self._pool.submit(_drive_part, url, model, wl, share, t0) for wl in parts]
        traces = [f.result() for f in futures]
        requests: dict[str, RequestTrace] = {}
        for tr in traces:
            requests.update(tr.requests)
        return RunTrace(requests, [], max(tr.wall for tr in traces))

    def close(self) -> None:
        self._pool.shutdown()


async def warm_up(client: httpx.AsyncClient, server: "ServerInfo", vocab: int,
                  num: int) -> None:
    """bench_serve.warmup_prompts through the server; a refusal here stops the bench."""
    kv_tokens = server.kv_blocks * server.block_size
    for b, batch in enumerate(warmup_prompts(vocab, server.max_model_len, kv_tokens, num)):
        traces = [HttpTrace(f"warmup-{b}-{i}", 0.0, len(p), WARMUP_TOKENS)
                  for i, p in enumerate(batch)]
        await asyncio.gather(*(stream_completion(client, server.model, p, tr, time.perf_counter)
                               for p, tr in zip(batch, traces)))
        problems = [p for tr in traces if (p := tr.problem()) is not None]
        if problems:
            raise IncompleteRun(f"warm-up through {server.url} failed: {problems[0]}")


# -- the server ---------------------------------------------------------------------------------

@dataclass
class ServerInfo:
    url: str
    model: str  # the name requests must give
    max_model_len: int
    kv_blocks: int
    block_size: int


async def describe(client: httpx.AsyncClient, url: str, block_size: int) -> ServerInfo:
    models = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
    metrics = await scrape(client)
    return ServerInfo(url, models["id"], int(models["max_model_len"]),
                      int(metrics["kv_total"]), block_size)


async def scrape(client: httpx.AsyncClient) -> dict:
    """The engine counters in /metrics, under bench_serve's names."""
    text = (await client.get("/metrics")).raise_for_status().text
    return parse_metrics(text)


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[METRICS[name]] = int(float(value))
    return out


# -- one mode -----------------------------------------------------------------------------------

def run_mode(args: argparse.Namespace, mode: str, cfg: WorkloadConfig,
             engine: dict | None, replicas: int = 1,
             routing: str | None = None) -> tuple[list[RunResult], dict, dict]:
    """The HTTP runs of one scheduling mode. `engine`: the in-process run's engine info (None
    with --http-only), whose options and sizes an auto-started server gets (each of its
    `replicas` data-parallel engines, routed by `routing`)."""
    transport = "http" + (f" dp{replicas}" if replicas > 1 else "") + (
        f" {routing}" if routing else "")
    block_size = int(engine_options(args, mode).get("block_size", DEFAULT_BLOCK_SIZE))
    if args.http != "auto":
        results, series, info = asyncio.run(_runs(args.http, args, mode, cfg, engine,
                                                  block_size, transport))
        return results, series, dict(info, url=args.http)
    try:
        options = server_options(args, mode, engine)
        port = free_port()
        # room for every request at once: offline sends them all at t = 0, as in-process
        argv = server_argv(args.model, options, port, max(256, args.num_requests + args.warmup))
        argv += ["--data-parallel-size", str(replicas)]
        argv += ["--data-parallel-routing", routing] if routing else []
    except ValueError as e:
        raise SystemExit(str(e)) from e
    name = os.path.basename(os.path.normpath(args.model))
    log = os.path.join(args.out, f"serve_{name}_server_{mode}_dp{replicas}"
                                 f"{'_' + routing if routing else ''}.log")
    print(f"starting the server ({mode}): python {' '.join(argv[1:])} (log: {log})",
          flush=True)
    with ServerProcess(argv, port, log) as server:
        server.wait_healthy(args.server_timeout)
        results, series, info = asyncio.run(_runs(server.url, args, mode, cfg, engine,
                                                  block_size, transport))
    if server.exit_code != 0:
        print(f"warning: the server exited with status {server.exit_code}; see {log}")
    return results, series, dict(info, url="auto", argv=argv[1:], exit_code=server.exit_code,
                                 log=log)


async def _runs(url: str, args: argparse.Namespace, mode: str, cfg: WorkloadConfig,
                engine: dict | None, block_size: int,
                transport: str) -> tuple[list[RunResult], dict, dict]:
    async with httpx.AsyncClient(base_url=url, limits=_NO_POOL_LIMIT,
                                 timeout=_NO_READ_TIMEOUT) as client:
        server = await describe(client, url, block_size)
        vocab = engine["vocab_size"] if engine is not None else model_vocab(args.model)
        if engine is not None and engine["max_model_len"] != server.max_model_len:
            print(f"warning: the server's max_model_len={server.max_model_len} differs from the "
                  f"in-process engine's {engine['max_model_len']}: the requests differ too")
        max_batch = engine["max_batch"] if engine else args.max_batch or DEFAULT_MAX_BATCH
        await warm_up(client, server, vocab, args.warmup)
        results, series, limits = [], {}, {}
        pool = ClientPool(args.client_procs) if args.client_procs > 1 else None
        try:
            for wl in build_workloads(cfg, args.kinds, args.rates, vocab,
                                      server.max_model_len):
                limit = concurrency(args, wl, max_batch)
                res = await _run_one(client, server, wl, mode, limit, pool, transport)
                print(json.dumps(row_brief(res)), flush=True)
                results.append(res)
                limits[res.label] = limit
                # the client sees chunks, not engine steps: no per-step series
                series[res.label] = dict(t_s=[], step_ms=[], tokens=[], batch=[],
                                         gpu_iter_ms=None, gpu_iter_prefill=None)
        finally:
            if pool is not None:
                pool.close()
    info = dict(model=server.model, max_model_len=server.max_model_len,
                kv_blocks=server.kv_blocks, max_batch=max_batch, concurrency=limits,
                client_procs=args.client_procs)
    return results, series, info


def concurrency(args: argparse.Namespace, workload: Workload, max_batch: int) -> int | None:
    """Streams open at once. Offline and shared-prefix: no limit, as the in-process driver
    holds nothing back. Online: enough to keep the batch full with as many queued behind it,
    like a client pool; a request waiting for a slot is late, and its TTFT says so."""
    if args.concurrency is not None:
        return args.concurrency
    return 2 * max_batch if workload.kind == "online" else None


async def _run_one(client: httpx.AsyncClient, server: ServerInfo, workload: Workload,
                   mode: str, limit: int | None, pool: ClientPool | None,
                   transport: str) -> RunResult:
    compiled, before = triton_cache_entries(), await scrape(client)
    if pool is None:
        trace = await drive(client, server.model, workload, limit)
    else:
        trace = await asyncio.to_thread(pool.drive, server.url, server.model, workload, limit)
    after = await scrape(client)
    return summarize(workload, mode, trace, before, after, None,
                     triton_cache_entries() - compiled, transport=transport)


def model_vocab(model: str) -> int:
    """The vocabulary of `model` from its config alone (no weights): --http-only has no engine
    of its own to ask, and the server does not say."""
    from graphexec.model.config import ModelConfig, preset
    from graphexec.model.gguf import config_from_gguf, open_gguf
    from graphexec.model.loader import resolve_model

    source = resolve_model(model)
    if source.kind == "gguf":
        gf = source.gguf if source.gguf is not None else open_gguf(source.path)
        return config_from_gguf(gf).vocab_size
    if source.kind == "hf":
        return ModelConfig.from_dir(source.path).vocab_size
    return preset(source.path).vocab_size
