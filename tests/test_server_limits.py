"""What the server refuses before reading a body (graphexec/serve/limits.py): a body over
--max-request-bytes (413), a missing API key (401), a POST that is not JSON (415).

The middleware is driven directly (to see that the body is never read) and through a real
server process on real sockets (the tiny random-weight preset: no tokenizer, token ids only).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from graphexec.serve.limits import RequestLimits  # noqa: E402
from test_server import Server  # noqa: E402

KEY = "sk-test-limits"
LIMIT = 4096


async def _echo_app(scope, receive, send) -> None:
    """Reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def _call(headers: dict[str, str], chunks: list[bytes], path: str = "/v1/completions",
          api_key: str | None = None) -> tuple[int, dict, dict | None, int]:
    """(status, response headers, JSON body or None, body messages the app read)."""
    limits = RequestLimits(_echo_app, max_bytes=LIMIT, api_key=api_key)
    reads, sent = [0], []

    async def receive():
        if reads[0] >= len(chunks):
            return {"type": "http.disconnect"}
        reads[0] += 1
        return {"type": "http.request", "body": chunks[reads[0] - 1],
                "more_body": reads[0] < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(limits(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert sum(m["type"] == "http.response.start" for m in sent) == 1, sent
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    hdrs = {k.decode(): v.decode() for k, v in start["headers"]}
    parsed = json.loads(body) if hdrs.get("content-type") == "application/json" else None
    return start["status"], hdrs, parsed, reads[0]


JSON = {"content-type": "application/json"}


def test_content_length_over_the_limit_is_413_before_any_read():
    status, hdrs, body, reads = _call({**JSON, "content-length": str(10 * LIMIT)}, [b"x"])
    assert status == 413 and reads == 0
    assert body["error"]["code"] == "request_too_large", body
    assert str(10 * LIMIT) in body["error"]["message"] and str(LIMIT) in body["error"]["message"]
    assert hdrs["connection"] == "close"


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit():
    chunks = [b"x" * 1000] * 10
    status, hdrs, body, reads = _call({**JSON, "transfer-encoding": "chunked"}, chunks)
    assert status == 413 and reads == 5  # 5000 bytes > 4096: not one chunk more
    assert body["error"]["code"] == "request_too_large" and hdrs["connection"] == "close"


def test_bodies_within_the_limit_pass_whole():
    for headers in ({**JSON, "content-length": str(LIMIT)}, {**JSON, "transfer-encoding": "x"}):
        status, _, _, reads = _call(headers, [b"x" * 1024] * 4)
        assert status == 200 and reads == 4


def test_no_key_is_401_before_any_read_and_only_under_v1():
    big = {**JSON, "content-length": str(10 * LIMIT)}
    for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
        status, hdrs, body, reads = _call({**big, **auth}, [b"x"], api_key=KEY)
        assert status == 401 and reads == 0, auth
        assert body["error"]["code"] == "invalid_api_key" and hdrs["www-authenticate"] == "Bearer"
    status, *_ = _call({**JSON, "authorization": f"bEaReR {KEY}"}, [b"{}"], api_key=KEY)
    assert status == 200
    status, *_ = _call(JSON, [b"{}"], path="/health", api_key=KEY)
    assert status == 200


def test_a_post_that_is_not_json_is_415_naming_the_content_type():
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=1"):
        status, _, body, reads = _call({"content-type": ctype}, [b"{}"])
        assert status == 415 and reads == 0, ctype
        err = body["error"]
        assert err["param"] == "Content-Type" and ctype in err["message"], err
        assert "application/json" in err["message"], err
    for ctype in ("application/json", "Application/JSON; charset=utf-8", "application/x+json"):
        assert _call({"content-type": ctype}, [b"{}"])[0] == 200, ctype
    assert _call({}, [b"{}"])[0] == 200  # no Content-Type: read as JSON, as FastAPI does
    assert _call({"content-type": "text/plain"}, [b"x"], path="/other")[0] == 200


def _raw(srv: Server, head: str, *chunks: bytes, wait: float = 10.0) -> bytes:
    """Sends head and chunks on a socket of its own; returns what came back until close."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=wait) as s:
        s.sendall(head.encode())
        for chunk in chunks:
            try:
                s.sendall(chunk)
            except OSError:  # the server answered and closed: what it said is below
                break
        out = b""
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                break
            if not got:
                break
            out += got
    return out


@pytest.fixture(scope="module")
def tiny():
    srv = Server("tiny", "--max-batch", "4", "--api-key", KEY,
                 "--max-request-bytes", str(LIMIT))
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def _head(length: str | None, key: str | None = KEY, ctype: str = "application/json") -> str:
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", f"Content-Type: {ctype}"]
    lines += [f"Authorization: Bearer {key}"] if key else []
    lines += [f"Content-Length: {length}"] if length else ["Transfer-Encoding: chunked"]
    return "\r\n".join(lines) + "\r\n\r\n"


def test_real_server_refuses_before_reading(tiny):
    t0 = time.monotonic()
    # 100 MB announced, nothing sent: answered at once, with no key or with one
    for key, status in ((None, 401), ("wrong", 401), (KEY, 413)):
        out = _raw(tiny, _head(str(100 * 2**20), key))
        assert out.startswith(f"HTTP/1.1 {status} ".encode()), out[:200]
        assert b"connection: close" in out.lower(), out[:300]
    assert time.monotonic() - t0 < 5
    # chunked, past the limit
    chunk = b"%x\r\n%s\r\n" % (1000, b" " * 1000)
    out = _raw(tiny, _head(None), *[chunk] * 20)
    assert out.startswith(b"HTTP/1.1 413 "), out[:200]
    assert b"request_too_large" in out
    r = httpx.post(tiny.url + "/v1/completions", content=b'{"model": "tiny"}', headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Type", r.text
    # the server goes on serving, with a body within the limit
    r = httpx.post(tiny.url + "/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}"}, json={"model": "tiny", "prompt": [5] * 500,
                                                  "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    assert httpx.get(tiny.url + "/health").status_code == 200


@pytest.mark.parametrize("ids", [[True], [3, False], [1.5], [2.0], ["3"]])
def test_stop_token_ids_take_integers_only(tiny, ids):
    r = httpx.post(tiny.url + "/v1/completions", timeout=30, headers={
        "Authorization": f"Bearer {KEY}"}, json={"model": "tiny", "prompt": [5, 6],
                                                  "max_tokens": 1, "stop_token_ids": ids})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    bad = next(i for i, v in enumerate(ids) if type(v) is not int)
    assert err["param"] == f"stop_token_ids[{bad}]", err
    assert "integer" in err["message"] and json.dumps(ids[bad]) in err["message"], err
