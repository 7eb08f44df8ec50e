"""Hostile and careless clients, on raw sockets, for tools/soak_server.py and
tools/probe_server.py. Each one does one kind of harm and says what the server answered:

- slow_headers: half a request's headers, then nothing (the server must cut it: 408);
- drip_body: headers, then a body a byte every half second (408 at the body timeout);
- vanish: a request cut off at a random byte, then gone (nothing to answer);
- bad_request: one of a sweep of malformed bodies (a 4xx in the OpenAI error shape);
- garbage: bytes that are not HTTP (a 400, or a closed connection).

A response of 5xx other than 503 is a failure, and so is a connection the server never closes.
"""
from __future__ import annotations

import asyncio
import json
import random

BAD_BODIES = [
    b'{"model": "%(model)s", "prompt": [10, 11], "max_tokens": -1}',
    b'{"model": "%(model)s", "prompt": [10, 11], "n": 100000}',
    b'{"model": "%(model)s", "prompt": [10, 1e400]}',
    b'{"model": "%(model)s", "prompt": [true, false]}',
    b'{"model": "%(model)s", "prompt": "a\\ud800"}',
    b'{"model": "%(model)s", "prompt": [10], "temperature": NaN}',
    b'{"model": "%(model)s", "prompt": [10], "stop": ""}',
    b'{"model": "%(model)s", "prompt": [10], "stop_token_ids": [1.5]}',
    b'{"model": "no-such-model", "prompt": [10]}',
    b'{"model": "%(model)s", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"model": "%(model)s", "messages": "hello"}',
    b"[" * 40000,
    b"not json at all",
    b"",
]


def _request(path: str, body: bytes, api_key: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def _answer(reader: asyncio.StreamReader, limit: float) -> tuple[int | None, bytes]:
    """The status and body of what the server sends before it closes (None: nothing)."""
    try:
        raw = await asyncio.wait_for(reader.read(), limit)
    except (TimeoutError, ConnectionError):
        return None, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        return int(head.split(b" ", 2)[1]), body
    except (IndexError, ValueError):
        return None, raw


class Hostile:
    """One server's hostile clients. `outcomes` counts what each kind got; `problems` keeps the
    first few failures."""

    def __init__(self, host: str, port: int, model: str, api_key: str | None,
                 close_within: float):
        self.host, self.port, self.model, self.api_key = host, port, model, api_key
        self.close_within = close_within  # the server's longest read timeout, plus slack
        self.outcomes: dict[str, int] = {}
        self.problems: list[str] = []

    def _count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def _fail(self, kind: str, detail: str) -> None:
        self._count(f"{kind}:FAIL")
        if len(self.problems) < 10:
            self.problems.append(f"{kind}: {detail}")

    async def _open(self):
        return await asyncio.open_connection(self.host, self.port)

    def _check(self, kind: str, status: int | None, body: bytes, want: tuple[int, ...]) -> None:
        if status is None:
            self._fail(kind, "the server never answered nor closed")
        elif status >= 500 and status != 503:
            self._fail(kind, f"HTTP {status}: {body[:200]!r}")
        elif status not in want:
            self._fail(kind, f"HTTP {status} where {want} was expected: {body[:200]!r}")
        else:
            if status != 503 and 400 <= status:
                try:
                    assert set(json.loads(body)["error"]) >= {"message", "type", "code"}
                except (ValueError, KeyError, TypeError, AssertionError):
                    self._fail(kind, f"HTTP {status} not in the OpenAI error shape: "
                                     f"{body[:200]!r}")
                    return
            self._count(f"{kind}:{status}")

    async def slow_headers(self, rng: random.Random) -> None:
        reader, writer = await self._open()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        status, body = await _answer(reader, self.close_within)
        writer.close()
        self._check("slow_headers", status, body, (408,))

    async def drip_body(self, rng: random.Random) -> None:
        reader, writer = await self._open()
        body = json.dumps({"model": self.model, "prompt": [10, 11]}).encode()
        writer.write(_request("/v1/completions", body, self.api_key)[:-len(body)])
        read = asyncio.ensure_future(_answer(reader, self.close_within))
        for byte in body[:-1]:
            if read.done():
                break
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(0.5)
        status, answer = await read
        writer.close()
        self._check("drip_body", status, answer, (408,))

    async def vanish(self, rng: random.Random) -> None:
        body = json.dumps({"model": self.model, "prompt": [10, 11, 12], "max_tokens": 64,
                           "stream": rng.random() < 0.5, "ignore_eos": True}).encode()
        raw = _request("/v1/completions", body, self.api_key)
        _, writer = await self._open()
        writer.write(raw[:rng.randrange(1, len(raw) + 1)])
        await asyncio.sleep(rng.uniform(0, 0.3))
        writer.close()
        self._count("vanish:done")

    async def bad_request(self, rng: random.Random) -> None:
        body = rng.choice(BAD_BODIES)
        if b"%(model)s" in body:
            body = body.replace(b"%(model)s", self.model.encode())
        reader, writer = await self._open()
        writer.write(_request("/v1/completions", body, self.api_key, "Connection: close\r\n"))
        status, answer = await _answer(reader, self.close_within)
        writer.close()
        self._check("bad_request", status, answer, (400, 404, 503))

    async def garbage(self, rng: random.Random) -> None:
        reader, writer = await self._open()
        writer.write(bytes(rng.randrange(256) for _ in range(rng.randint(10, 2000))))
        status, answer = await _answer(reader, self.close_within)
        writer.close()
        if status is None and not answer:
            self._count("garbage:closed")  # closed without a word: fine for non-HTTP
        else:
            self._check("garbage", status, answer, (400, 408))

    KINDS = ("slow_headers", "drip_body", "vanish", "bad_request", "garbage")

    async def one(self, rng: random.Random) -> None:
        kind = rng.choice(self.KINDS)
        try:
            await getattr(self, kind)(rng)
        except OSError as e:
            self._fail(kind, f"{type(e).__name__}: {e}")
