"""How many streamed tokens a second the HTTP front end alone can carry: the server of
`python -m graphexec.serve` over a paced stand-in engine (one token per request every
--step-ms, no model), read by --client-procs processes of streaming clients. With a real
engine behind it, the server cannot deliver more than this.

Two figures: tokens a second as the clients received them, and the HTTP process's own CPU
time per token (from /proc). On a machine with few cores the clients and the stand-in engines
take CPU from the server, so the first understates its ceiling; the second does not depend on
what else runs, and one core divided by it is what one HTTP process could carry.

    python tools/bench_frontend.py --streams 1600 --tokens 200 --step-ms 10
    python tools/bench_frontend.py --profile /tmp/frontend.prof   # cProfile of the server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import socket
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PacedEngine:
    """What the engine process needs of an Engine: every live request gets one token a step,
    and a step takes step_ms (a GPU's decode step, without the GPU)."""

    def __init__(self, step_ms: float, max_batch: int):
        self.step_s, self.max_batch = step_ms / 1e3, max_batch
        self.requests: dict[str, tuple[list[int], list[int], int]] = {}
        self.steps = self.tokens = 0
        self.pool = SimpleNamespace(num_blocks=1 << 20)
        self.max_model_len = 1 << 20
        self.model_config = SimpleNamespace(vocab_size=32000)
        self.config = SimpleNamespace(block_size=16)
        self.runner = SimpleNamespace(k=0)
        self.tokenizer = None

    def add_request(self, request_id, prompt, params) -> None:
        self.requests[request_id] = (list(prompt), [], params.max_tokens)

    def abort(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        self.requests.clear()

    def step(self) -> list:
        # imported here: the client processes re-import this module, and graphexec brings torch
        from graphexec.outputs import RequestOutput

        time.sleep(self.step_s)
        self.steps += 1
        outs = []
        for rid in list(self.requests)[:self.max_batch]:
            prompt, tokens, want = self.requests[rid]
            tokens.append(7)
            done = len(tokens) >= want
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, prompt, tokens, [7], "length" if done else None,
                                      new_text=_WORDS[len(tokens) % len(_WORDS)]))
        self.tokens += len(outs)
        return outs

    def stats_summary(self) -> dict:
        n = len(self.requests)
        zero = dict.fromkeys(("chain_breaks", "pauses", "evictions", "cached_blocks",
                              "prefix_query_tokens", "prefix_hit_tokens", "paused",
                              "kv_used"), 0)
        return dict(zero, steps=self.steps, tokens=self.tokens, batch_rows=self.tokens,
                    running=min(n, self.max_batch), waiting=max(0, n - self.max_batch),
                    kv_total=self.pool.num_blocks)


# Each token's text: a word as a tokenizer would give it, one with a character JSON escapes.
_WORDS = (" the", " model", " said", ' "yes"', " and", " é", "\n", " ok")


def paced_engine(step_ms: float, max_batch: int) -> PacedEngine:
    return PacedEngine(step_ms, max_batch)


def serve(port: int, step_ms: float, max_batch: int, replicas: int) -> None:
    """The server process: graphexec.serve's app over paced engines."""
    import functools

    import uvicorn

    from graphexec.serve.app import build_app
    from graphexec.serve.config import ServeConfig
    from graphexec.serve.timeouts import ReadTimeouts, protocol_class

    factory = functools.partial(paced_engine, step_ms, max_batch)
    config = ServeConfig(model="paced", served_model_name="paced", max_queue=1 << 20,
                         routing="load")
    app = build_app(config, [factory] * replicas, log_level="WARNING")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                http=protocol_class(ReadTimeouts()))


_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')


class _Stream(asyncio.Protocol):
    """One streamed completion read off a raw socket: a client that costs little CPU, so on a
    small machine the server rather than the client is what is measured. It counts the token
    ids and the SSE events it receives."""

    def __init__(self, request: bytes, done: asyncio.Future):
        self.request, self.done = request, done
        self.buf = b""
        self.tokens = self.events = 0

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self.buf = buf
            return
        whole, self.buf = buf[:end], buf[end + 2:]
        self.events += whole.count(b"data: {")
        for ids in _IDS.findall(whole):
            if ids:
                self.tokens += ids.count(b",") + 1
        if whole.endswith(b"data: [DONE]") and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed before [DONE]"))


async def _streams(port: int, count: int, tokens: int, out) -> None:
    body = json.dumps({"model": "paced", "prompt": [1, 2, 3], "max_tokens": tokens,
                       "stream": True, "return_token_ids": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
               f"Connection: close\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()

    async def one() -> _Stream:
        done = loop.create_future()
        transport, stream = await loop.create_connection(lambda: _Stream(request, done),
                                                         "127.0.0.1", port)
        try:
            await done
        finally:
            transport.close()
        return stream

    streams = await asyncio.gather(*(one() for _ in range(count)))
    out.put((sum(s.tokens for s in streams), sum(s.events for s in streams)))


def _client_proc(port: int, count: int, tokens: int, out, ready, go) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    ready.release()
    go.wait()  # the clock starts once every client process is up
    asyncio.run(_streams(port, count, tokens, out))


def _cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds of a process, all its threads (Linux /proc; None
    elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1600)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--max-batch", type=int, default=256, help="rows a paced step serves")
    ap.add_argument("--replicas", type=int, default=1, help="paced engines behind the server")
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of streams, one server")
    ap.add_argument("--profile", default=None, help="write the server's cProfile here")
    args = ap.parse_args()
    import httpx  # the client side only: the server process imports its own

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    if args.profile:
        target = _profiled_serve
        sargs = (args.profile, port, args.step_ms, args.max_batch, args.replicas)
    else:
        target, sargs = serve, (port, args.step_ms, args.max_batch, args.replicas)
    server = ctx.Process(target=target, args=sargs)
    server.start()
    while True:
        if not server.is_alive():  # it failed to start (its error is on stderr above)
            sys.exit(f"the server process ended with exit code {server.exitcode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    for _ in range(args.repeat):
        _round(args, port, server.pid, ctx)
    server.terminate()
    server.join()


def _round(args, port: int, server_pid: int, ctx) -> None:
    out = ctx.Queue()
    share = [args.streams // args.client_procs + (i < args.streams % args.client_procs)
             for i in range(args.client_procs)]
    ready, go = ctx.Semaphore(0), ctx.Event()
    clients = [ctx.Process(target=_client_proc, args=(port, n, args.tokens, out, ready, go))
               for n in share if n]
    for c in clients:
        c.start()
    for _ in clients:
        ready.acquire()
    cpu0 = _cpu_seconds(server_pid)
    t = time.perf_counter()
    go.set()
    got = [out.get() for _ in clients]
    wall = time.perf_counter() - t
    cpu1 = _cpu_seconds(server_pid)
    for c in clients:
        c.join()
    total, events = sum(g[0] for g in got), sum(g[1] for g in got)
    # every engine steps each step_ms, each step one token for up to max_batch of its streams
    engine_rate = min(args.streams, args.max_batch * args.replicas) / (args.step_ms / 1e3)
    print(f"{args.streams} streams x {args.tokens} tokens over {args.replicas} paced "
          f"engine(s) at {args.step_ms:g} ms a step: {total} tokens in {wall:.2f} s = "
          f"{total / wall:,.0f} tokens/s through the server (the engines alone: "
          f"{engine_rate:,.0f}); {total / max(events, 1):.2f} tokens a chunk")
    if cpu0 is not None and cpu1 is not None and total:
        user, system = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        used = user + system
        print(f"  HTTP process: {used:.2f} CPU s ({user:.2f} user, {system:.2f} system), "
              f"{used / total * 1e6:.1f} us a token = {total / max(used, 1e-9):,.0f} tokens "
              f"per CPU second")


def _profiled_serve(path: str, *args) -> None:
    import cProfile
    import signal

    prof = cProfile.Profile()

    def dump(*_):
        prof.disable()
        prof.dump_stats(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    prof.enable()
    serve(*args)


if __name__ == "__main__":
    main()
