"""Soak test of the OpenAI-compatible server: requests arrive faster than it can serve them.

Open-loop Poisson arrivals at --rate for --duration seconds, a mix of streamed and non-streamed
completions (token-id prompts, ignore_eos, so every finished request must carry exactly
max_tokens tokens), some clients hanging up mid-stream or mid-wait. Refusals (503, the queue
is full) are expected above capacity and counted apart. Hostile clients (tools/hostile_clients.py:
slow headers, dripped bodies, malformed requests, garbage, vanishing mid-request) arrive beside
them at --hostile-rate; each must get its 4xx or have its connection cut. Throughout, the server's RSS (its
engine process included) and /health are sampled. At the end: every request must have an outcome (none lost, none hung), the engine
must drain to zero running / waiting / KV blocks, and (when this script started the server)
SIGTERM must end it with status 0.

    python tools/soak_server.py --duration 180                  # starts a tiny CPU server
    python tools/soak_server.py --url http://host:8000 --model NAME --pid PID
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from hostile_clients import Hostile


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # completed requests, seconds
    ttfts: list[float] = field(default_factory=list)  # completed streams
    tokens: int = 0
    problems: list[str] = field(default_factory=list)  # the first few, for the summary
    hostile: Hostile | None = None

    def fail(self, kind: str, detail: str) -> None:
        self.outcomes[kind] += 1
        if len(self.problems) < 10:
            self.problems.append(f"{kind}: {detail}")


@dataclass
class Samples:
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB)
    health_ok: int = 0
    health_bad: Counter = field(default_factory=Counter)


def _rss_mb(pid: int) -> float | None:
    """The resident memory of the server and every process under it (its engine process)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    except OSError:
        return None
    total = int(m.group(1)) / 1024 if m else 0.0
    for child in _children(pid):
        total += _rss_mb(child) or 0.0
    return total


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


async def one_request(client: httpx.AsyncClient, args, rng: random.Random, tally: Tally) -> None:
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    body = {"model": args.model, "prompt": [rng.randrange(3, args.vocab)
                                             for _ in range(rng.randint(4, args.max_prompt))],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1 << 30)}
    streamed = rng.random() < args.stream_fraction
    hang_up = rng.random() < args.hangup_fraction
    start = time.monotonic()
    try:
        async with asyncio.timeout(args.request_timeout):
            if streamed:
                await _streamed(client, body, hang_up, rng, start, tally)
            elif hang_up:  # the client gives up before the answer
                try:
                    async with asyncio.timeout(rng.uniform(0.01, 0.5)):
                        await client.post("/completions", json=body)
                except TimeoutError:
                    pass
                tally.outcomes["hung_up"] += 1
            else:
                r = await client.post("/completions", json=body)
                if r.status_code == 503:
                    tally.outcomes["refused_503"] += 1
                    return
                if r.status_code != 200:
                    tally.fail("error", f"HTTP {r.status_code}: {r.text[:200]}")
                    return
                got = r.json()["usage"]["completion_tokens"]
                if got != max_tokens or r.json()["choices"][0]["finish_reason"] != "length":
                    tally.fail("wrong", f"{got} tokens for max_tokens={max_tokens}")
                    return
                tally.outcomes["ok"] += 1
                tally.tokens += got
                tally.latencies.append(time.monotonic() - start)
    except TimeoutError:
        tally.fail("hung", f"no answer within {args.request_timeout} s (streamed={streamed})")
    except httpx.HTTPError as e:
        tally.fail("error", f"{type(e).__name__}: {e}")


async def _streamed(client, body, hang_up, rng, start, tally: Tally) -> None:
    body = {**body, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    leave_after = rng.randint(1, 5)
    async with client.stream("POST", "/completions", json=body) as r:
        if r.status_code == 503:
            await r.aread()
            tally.outcomes["refused_503"] += 1
            return
        if r.status_code != 200:
            tally.fail("error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        tokens, finish, usage, done, chunks, first = 0, None, None, False, 0, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            msg = json.loads(line[6:])
            if "error" in msg:
                tally.fail("error", f"error event: {msg['error']['message']}")
                return
            usage = msg.get("usage") or usage
            for c in msg["choices"]:
                tokens += len(c.get("token_ids", []))
                finish = c["finish_reason"] or finish
            chunks += 1
            if first is None and tokens:
                first = time.monotonic() - start
            if hang_up and chunks >= leave_after:
                tally.outcomes["hung_up"] += 1
                return  # leaving the block closes the connection mid-stream
    want = body["max_tokens"]
    if not done or tokens != want or finish != "length" or (
            usage is None or usage["completion_tokens"] != want):
        tally.fail("wrong", f"stream: done={done} tokens={tokens} finish={finish} "
                            f"usage={usage} for max_tokens={want}")
        return
    tally.outcomes["ok"] += 1
    tally.tokens += tokens
    tally.latencies.append(time.monotonic() - start)
    if first is not None:
        tally.ttfts.append(first)


async def sample(url: str, pid: int | None, stop: asyncio.Event, samples: Samples,
                 t0: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        tick = 0
        while not stop.is_set():
            try:
                r = await c.get("/health")
                if r.status_code == 200:
                    samples.health_ok += 1
                else:
                    samples.health_bad[f"HTTP {r.status_code}"] += 1
            except httpx.HTTPError as e:
                samples.health_bad[type(e).__name__] += 1
            if pid is not None and tick % 2 == 0:
                rss = _rss_mb(pid)
                if rss is not None:
                    samples.rss_mb.append((time.monotonic() - t0, rss))
            tick += 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def hostile_arrivals(args, hostile: Hostile, until: float) -> None:
    """Hostile clients at --hostile-rate until `until`; returns once every one has ended."""
    rng = random.Random(args.seed + 1)
    tasks = set()
    while time.monotonic() < until:
        await asyncio.sleep(rng.expovariate(args.hostile_rate))
        tasks.add(asyncio.create_task(hostile.one(random.Random(rng.random()))))
    if tasks:
        await asyncio.wait(tasks)


async def drive(args, url: str, pid: int | None) -> tuple[Tally, Samples, dict, float]:
    rng = random.Random(args.seed)
    tally, samples = Tally(), Samples()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_inflight + 8, max_keepalive_connections=64)
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample(url, pid, stop, samples, t0))
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    hostile = Hostile(host, int(port), args.model, args.api_key, args.hostile_close_within)
    attackers = asyncio.create_task(hostile_arrivals(
        args, hostile, t0 + args.duration)) if args.hostile_rate > 0 else None
    tasks: set[asyncio.Task] = set()
    async with httpx.AsyncClient(base_url=url + "/v1", headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.request_timeout)) as client:
        next_at = t0
        sent = 0
        last_report = t0
        while (now := time.monotonic()) < t0 + args.duration:
            if now < next_at:
                await asyncio.sleep(min(next_at - now, 0.05))
                continue
            next_at += rng.expovariate(args.rate)
            if len(tasks) >= args.max_inflight:
                tally.outcomes["skipped_client_cap"] += 1
                continue
            t = asyncio.create_task(one_request(client, args, random.Random(rng.random()),
                                                tally))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            sent += 1
            if now - last_report >= args.report_every:
                last_report = now
                rss = samples.rss_mb[-1][1] if samples.rss_mb else float("nan")
                print(f"[{now - t0:6.0f} s] sent {sent}, in flight {len(tasks)}, "
                      f"{dict(tally.outcomes)}, RSS {rss:.0f} MiB", flush=True)
        # every request must end on its own: the per-request timeout marks the hung ones
        if tasks:
            await asyncio.wait(set(tasks), timeout=args.request_timeout + 10)
        lost = len([t for t in tasks if not t.done()])
        if lost:
            tally.fail("lost", f"{lost} requests never ended")
        if attackers is not None:
            await attackers
    tally.hostile = hostile
    elapsed = time.monotonic() - t0
    final = await drained(url, headers)
    stop.set()
    await sampler
    tally.outcomes["sent"] = sent
    return tally, samples, final, elapsed


async def drained(url: str, headers: dict, wait: float = 15.0) -> dict:
    """The engine's gauges once it has emptied (or as they stand after `wait` seconds)."""
    names = ("graphexec_requests_running", "graphexec_requests_waiting",
             "graphexec_kv_blocks_used")
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        deadline = time.monotonic() + wait
        while True:
            text = (await c.get("/metrics")).text
            vals = {n: _metric(text, n) for n in names}
            if all(v == 0 for v in vals.values()) or time.monotonic() > deadline:
                for n in ("graphexec_generation_tokens_total", "graphexec_engine_steps_total",
                          "graphexec_engine_pauses_total", "graphexec_engine_evictions_total"):
                    vals[n] = _metric(text, n)
                return vals
            await asyncio.sleep(0.2)


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "graphexec.serve", "--model", args.model, "--device",
           args.device, "--port", str(port), *args.server_args.split()]
    print("server:", " ".join(cmd), "log:", log.name, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"the server was not healthy within 300 s; see {log.name}")


def summarize(args, tally: Tally, samples: Samples, final: dict, elapsed: float,
              exit_code: int | None) -> bool:
    o = tally.outcomes
    print("\n== soak summary ==")
    print(f"duration {elapsed:.0f} s at {args.rate}/s offered; outcomes: {dict(o)}")
    bad = o["lost"] + o["hung"] + o["wrong"] + o["error"]
    print(f"lost {o['lost']}, hung {o['hung']}, wrong {o['wrong']}, errors {o['error']}")
    if tally.latencies:
        lat = sorted(tally.latencies)
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
        print(f"completed {len(lat)}: {tally.tokens} tokens = {tally.tokens / elapsed:.1f} "
              f"tokens/s, {len(lat) / elapsed:.2f} requests/s; latency p50 {q[49]:.2f} s, "
              f"p95 {q[94]:.2f} s, p99 {q[98]:.2f} s")
    if tally.ttfts:
        tq = statistics.quantiles(sorted(tally.ttfts), n=100) if len(tally.ttfts) > 1 else (
            [tally.ttfts[0]] * 99)
        print(f"time to first token (streams): p50 {tq[49]:.3f} s, p95 {tq[94]:.3f} s")
    if samples.rss_mb:
        rss = samples.rss_mb
        warm = [v for t, v in rss if t >= elapsed * 0.1] or [v for _, v in rss]
        half = [(t, v) for t, v in rss if t >= elapsed / 2]
        slope = 0.0
        if len(half) >= 2:
            slope = (half[-1][1] - half[0][1]) / max(half[-1][0] - half[0][0], 1) * 60
        print(f"server RSS: start {rss[0][1]:.0f} MiB, after warm-up {warm[0]:.0f}, peak "
              f"{max(v for _, v in rss):.0f}, end {rss[-1][1]:.0f}; second half "
              f"{slope:+.1f} MiB/min")
    print(f"/health: {samples.health_ok} ok, not ok: {dict(samples.health_bad)}")
    hostile_failed = 0
    if tally.hostile is not None:
        h = tally.hostile
        hostile_failed = sum(v for k, v in h.outcomes.items() if k.endswith(":FAIL"))
        print(f"hostile clients: {dict(sorted(h.outcomes.items()))}; failed {hostile_failed}")
        for p in h.problems:
            print("  ", p)
    print(f"after the run: {final}")
    drained_ok = all(final.get(n) == 0 for n in ("graphexec_requests_running",
                                                  "graphexec_requests_waiting",
                                                  "graphexec_kv_blocks_used"))
    if exit_code is not None:
        print(f"server exit status after SIGTERM: {exit_code}")
    for p in tally.problems:
        print("  ", p)
    ok = bad == 0 and hostile_failed == 0 and drained_ok and not samples.health_bad and exit_code in (None, 0)
    print("PASS" if ok else "FAIL")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--pid", type=int, default=None, help="its pid, for RSS (with --url)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--server-args", default="--max-batch 32 --max-queue 64 --num-kv-blocks 256 "
                    "--timeout-headers 5 --timeout-body 10",
                    help="extra flags for a server this script starts")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second offered")
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=500, help="prompt ids are drawn below this")
    ap.add_argument("--stream-fraction", type=float, default=0.6)
    ap.add_argument("--hangup-fraction", type=float, default=0.15)
    ap.add_argument("--max-inflight", type=int, default=400, help="client-side cap")
    ap.add_argument("--request-timeout", type=float, default=120.0,
                    help="a request without an answer by then counts as hung")
    ap.add_argument("--hostile-rate", type=float, default=2.0,
                    help="hostile clients per second (0: none)")
    ap.add_argument("--hostile-close-within", type=float, default=20.0,
                    help="seconds by which the server must have answered or cut a hostile "
                         "client: its longest read timeout plus slack")
    ap.add_argument("--report-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    proc = None
    if args.url is None:
        proc, url, _ = start_server(args)
        pid = proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    exit_code = None
    try:
        tally, samples, final, elapsed = asyncio.run(drive(args, url, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = "killed after 60 s"
    ok = summarize(args, tally, samples, final, elapsed, exit_code)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
