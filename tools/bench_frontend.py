"""How many streamed tokens a second the HTTP front end alone can carry: the server of
`python -m graphexec.serve` over a paced stand-in engine (one token per request every
--step-ms, no model), read by --client-procs processes of streaming clients. With a real
engine behind it, the server cannot deliver more than this.

    python tools/bench_frontend.py --streams 1600 --tokens 200 --step-ms 10
    python tools/bench_frontend.py --profile /tmp/frontend.prof   # cProfile of the server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphexec.outputs import RequestOutput  # noqa: E402


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

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        self.steps += 1
        outs = []
        for rid in list(self.requests)[:self.max_batch]:
            prompt, tokens, want = self.requests[rid]
            tokens.append(7)
            done = len(tokens) >= want
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, prompt, tokens, [7], "length" if done else None))
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


async def _streams(url: str, count: int, tokens: int, out) -> None:
    import httpx

    body = {"model": "paced", "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True,
            "return_token_ids": True}
    got = [0]

    async def one(client) -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got[0] += len(c.get("token_ids", ()))

    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await asyncio.gather(*(one(client) for _ in range(count)))
    out.put(got[0])


def _client_proc(url: str, count: int, tokens: int, out) -> None:
    asyncio.run(_streams(url, count, tokens, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1600)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--max-batch", type=int, default=256, help="rows a paced step serves")
    ap.add_argument("--replicas", type=int, default=1, help="paced engines behind the server")
    ap.add_argument("--client-procs", type=int, default=8)
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
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    out = ctx.Queue()
    share = [args.streams // args.client_procs + (i < args.streams % args.client_procs)
             for i in range(args.client_procs)]
    t = time.perf_counter()
    clients = [ctx.Process(target=_client_proc, args=(url, n, args.tokens, out))
               for n in share if n]
    for c in clients:
        c.start()
    total = sum(out.get() for _ in clients)
    wall = time.perf_counter() - t
    for c in clients:
        c.join()
    # every engine steps each step_ms, each step one token for up to max_batch of its streams
    engine_rate = min(args.streams, args.max_batch * args.replicas) / (args.step_ms / 1e3)
    print(f"{args.streams} streams x {args.tokens} tokens over {args.replicas} paced "
          f"engine(s) at {args.step_ms:g} ms a step: {total} tokens in {wall:.2f} s = "
          f"{total / wall:,.0f} tokens/s through the server (the engines alone: "
          f"{engine_rate:,.0f})")
    server.terminate()
    server.join()


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
