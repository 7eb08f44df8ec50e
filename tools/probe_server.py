"""Measures what hostile clients cost the other clients of a server this script starts (CPU):

- stall: while a 10 MB text prompt is parsed, tokenised and refused, the slowest /health
  answer, and a concurrent stream's largest gap between chunks against the same stream's
  largest gap without it;
- sigterm: open streams and a SIGTERM every second for ten seconds: every stream must end with
  [DONE], and the process must exit within --shutdown-timeout plus 2 s;
- slowloris: 100 connections that send half their headers: a normal request's latency before
  and meanwhile, and when the server has closed all 100.

    python tools/probe_server.py stall sigterm slowloris
"""
from __future__ import annotations

import argparse
import signal
import socket
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests")
from test_server import Server  # noqa: E402  (the tests' server process, reused as it is)


def _stream_gaps(url: str, model: str, tokens: int, out: list[float],
                 started: threading.Event) -> None:
    """Streams a completion; `out` gets the gaps between chunks (seconds)."""
    body = {"model": model, "prompt": [10, 11, 12, 13], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            last = now
            started.set()


def _health_max(url: str, busy: threading.Event) -> float:
    worst = 0.0
    while busy.is_set():
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.02)
    return worst


def stall(model: str) -> None:
    srv = Server(model, "--max-batch", "4", "--max-model-len", "512",
                 "--max-request-bytes", str(16 << 20))
    try:
        tokens = 150
        alone: list[float] = []
        _stream_gaps(srv.url, model, tokens, alone, threading.Event())
        gaps: list[float] = []
        started = threading.Event()
        stream = threading.Thread(target=_stream_gaps,
                                  args=(srv.url, model, tokens, gaps, started))
        stream.start()
        started.wait(60)
        busy = threading.Event()
        busy.set()
        worst: list[float] = []
        prober = threading.Thread(target=lambda: worst.append(_health_max(srv.url, busy)))
        prober.start()
        text = "hello world, this is a prompt. " * (10_000_000 // 31)
        t = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": text},
                       timeout=300)
        took = time.perf_counter() - t
        busy.clear()
        prober.join()
        stream.join()
        print(f"stall: 10 MB prompt answered {r.status_code} "
              f"({r.json()['error']['code']}) in {took:.2f} s")
        print(f"stall: /health slowest {worst[0] * 1000:.0f} ms meanwhile (goal < 200 ms)")
        print(f"stall: stream's largest chunk gap {max(gaps) * 1000:.0f} ms with it, "
              f"{max(alone) * 1000:.0f} ms alone: {max(gaps) / max(alone):.2f}x (goal < 2x); "
              f"median gap {statistics.median(gaps) * 1000:.1f} / "
              f"{statistics.median(alone) * 1000:.1f} ms")
    finally:
        srv.stop()


def sigterm(model: str, timeout: float = 5.0, streams: int = 8) -> None:
    srv = Server(model, "--max-batch", "8", "--shutdown-timeout", str(timeout))
    ends: list[str] = []
    first: list[float] = []

    def one() -> None:
        body = {"model": model, "prompt": [10, 11, 12, 13], "max_tokens": 2000,
                "stream": True, "ignore_eos": True}
        last = ""
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        last = line
        except httpx.HTTPError as e:
            last = f"cut: {type(e).__name__}"
        ends.append(last)

    clients = [threading.Thread(target=one) for _ in range(streams)]
    for c in clients:
        c.start()
    time.sleep(2)

    def signal_every_second() -> None:
        for _ in range(10):
            if srv.proc.poll() is not None:
                return
            srv.proc.send_signal(signal.SIGTERM)
            first.append(time.monotonic())
            time.sleep(1)

    sender = threading.Thread(target=signal_every_second)
    sender.start()
    code = srv.proc.wait(timeout + 30)
    exited = time.monotonic() - first[0]
    sender.join()
    for c in clients:
        c.join()
    done = sum(e == "data: [DONE]" for e in ends)
    print(f"sigterm: {len(first)} signals sent; the streams' last lines: {sorted(set(ends))}")
    print(f"sigterm: {done}/{streams} streams ended with [DONE]; exit status {code} "
          f"{exited:.2f} s after the first signal (goal < {timeout + 2:.0f} s)")
    srv.stop()


def slowloris(model: str, clients: int = 100, headers_s: float = 5.0) -> None:
    srv = Server(model, "--max-batch", "4", "--timeout-headers", str(headers_s))
    body = {"model": model, "prompt": [10, 11, 12], "max_tokens": 8}

    def normal() -> float:
        t = time.perf_counter()
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        return time.perf_counter() - t

    try:
        before = [normal() for _ in range(20)]
        socks = []
        for _ in range(clients):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=headers_s + 30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t = time.monotonic()
        during = [normal() for _ in range(20)]
        closed, statuses = [], []
        for s in socks:
            raw = b""
            while chunk := s.recv(4096):
                raw += chunk
            closed.append(time.monotonic() - t)
            statuses.append(raw.split(b" ", 2)[1].decode() if raw else "none")
            s.close()
        print(f"slowloris: normal request p50 {statistics.median(before) * 1000:.0f} ms "
              f"before, {statistics.median(during) * 1000:.0f} ms with {clients} slow clients "
              f"(max {max(before) * 1000:.0f} / {max(during) * 1000:.0f} ms)")
        answers = {x: statuses.count(x) for x in set(statuses)}
        print(f"slowloris: all {clients} closed {max(closed):.2f} s after they were opened "
              f"(timeout {headers_s:g} s); answers {answers}")
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probes", nargs="+", choices=("stall", "sigterm", "slowloris"))
    ap.add_argument("--model", default="smollm2-135m",
                    help="stall needs a tokenizer; the others run on any model")
    args = ap.parse_args()
    for probe in args.probes:
        {"stall": stall, "sigterm": sigterm, "slowloris": slowloris}[probe](args.model)


if __name__ == "__main__":
    main()
