"""The server against hostile and careless clients: a real server process on real sockets.

Each class of abuse is sent, and after each the server must still answer /health and a normal
request, with no request or KV block left behind (graphexec/serve/timeouts.py for the slow
clients, body.py and limits.py for the bodies, params.py and prompts.py for the fields).
"""
from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest

from test_server import Server

httpx = pytest.importorskip("httpx")

HEADERS_S, BODY_S, KEEP_ALIVE_S = 1.0, 2.0, 1.0
KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = Server("tiny", "--max-batch", "4", "--max-model-len", "256", "--max-queue", "16",
                 "--api-key", KEY, "--max-request-bytes", "65536",
                 "--timeout-headers", str(HEADERS_S), "--timeout-body", str(BODY_S),
                 "--timeout-keep-alive", str(KEEP_ALIVE_S))
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def _connect(srv: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=30)


def _read_all(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed."""
    out = b""
    while True:
        try:
            got = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not got:
            break
        out += got
    return out, time.monotonic()


def _status_and_error(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    try:
        return status, json.loads(body)["error"]
    except ValueError:
        return status, None


def _post(srv: Server, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def _normal(srv: Server) -> float:
    """A normal request's latency; it must succeed."""
    t = time.perf_counter()
    r = _post(srv, {"model": "tiny", "prompt": [10, 11, 12], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) >= 0
    return time.perf_counter() - t


def _settled(srv: Server) -> None:
    """Nothing running, nothing waiting, no KV block held."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = [srv.metric(f"graphexec_{m}") for m in
                ("requests_running", "requests_waiting", "kv_blocks_used")]
        if held == [0, 0, 0]:
            return
        time.sleep(0.1)
    pytest.fail(f"requests or KV blocks left behind: {held}")


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"],
                         ids=["silent", "half-headers"])
def test_slow_headers_get_408_and_a_closed_connection(server, sent):
    s = _connect(server)
    t = time.monotonic()
    s.sendall(sent)
    raw, closed = _read_all(s)
    s.close()
    assert HEADERS_S - 0.1 < closed - t < HEADERS_S + 2, closed - t
    status, err = _status_and_error(raw)
    assert status == 408 and err["code"] == "request_timeout", raw


def test_headers_dripped_a_byte_at_a_time_are_cut_at_the_deadline(server):
    s = _connect(server)
    t = time.monotonic()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100
    closed_early = False
    for byte in request:  # 0.1 s a byte: 10 s for the whole header, far past the timeout
        try:
            s.sendall(bytes([byte]))
        except OSError:
            closed_early = True
            break
        time.sleep(0.1)
        if time.monotonic() - t > HEADERS_S + 2:
            break
    raw, closed = _read_all(s)
    s.close()
    assert closed_early or closed - t < HEADERS_S + 2.5, closed - t
    assert _status_and_error(raw)[0] == 408, raw


def test_bytes_that_are_not_http_get_a_400_in_the_error_shape(server):
    s = _connect(server)
    s.sendall(b"\x16\x03\x01\x02\x00GARBAGE\r\n\r\n")  # a TLS hello, say, on a plain port
    raw, _ = _read_all(s)
    s.close()
    status, err = _status_and_error(raw)
    assert status == 400 and err["code"] == "invalid_http", raw


def test_a_slow_body_gets_408_and_leaves_nothing_behind(server):
    s = _connect(server)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n").encode()
    t = time.monotonic()
    s.sendall(head + b'{"model": "tiny", ')
    raw, closed = _read_all(s)
    s.close()
    assert BODY_S - 0.1 < closed - t < BODY_S + 2, closed - t
    status, err = _status_and_error(raw)
    assert status == 408 and "body" in err["message"], raw
    _normal(server)
    _settled(server)


def test_an_idle_kept_alive_connection_is_closed(server):
    s = _connect(server)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    t = time.monotonic()
    raw, closed = _read_all(s)
    s.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw
    assert closed - t < KEEP_ALIVE_S + 2, closed - t


def test_a_hundred_slow_header_clients_are_all_closed_while_others_are_served(server):
    socks = []
    for _ in range(100):
        s = _connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t = time.monotonic()
    for _ in range(3):  # served meanwhile (their latency is measured by tools/soak_server.py)
        _normal(server)
    closed = []
    for s in socks:
        raw, when = _read_all(s)
        s.close()
        closed.append(when - t)
        assert _status_and_error(raw)[0] == 408, raw
    assert max(closed) < HEADERS_S + 3, max(closed)
    _settled(server)


# (body as sent, headers) -> the status and the field the error names; every one a 4xx.
_BAD = [
    (b'{"model": "tiny", "prompt": [10, 11], "max_tokens": -1}', {}, 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": [10, 11], "n": 100000}', {}, 400, "n"),
    (b'{"model": "tiny", "prompt": [10, 1e400]}', {}, 400, "prompt"),
    (b'{"model": "tiny", "prompt": [10, 99999999999999999999999]}', {}, 400, "prompt"),
    (b'{"model": "tiny", "prompt": [true, false]}', {}, 400, "prompt"),
    (b'{"model": "tiny", "prompt": []}', {}, 400, "prompt"),
    (b'{"model": "tiny", "prompt": [10], "temperature": "hot"}', {}, 400, "temperature"),
    (b'{"model": "tiny", "prompt": [10], "temperature": NaN}', {}, 400, "temperature"),
    (b'{"model": "tiny", "prompt": [10], "stop_token_ids": [1.5]}', {}, 400, "stop_token_ids"),
    (b'{"model": "tiny", "prompt": [10], "seed": 1e30}', {}, 400, "seed"),
    (b'{"model": "tiny", "prompt": [' + b",".join([b"10"] * 300) + b"]}", {}, 400, "prompt"),
    (b'{"model": "nope", "prompt": [10]}', {}, 404, "model"),
    (b'{"prompt": [10]}', {}, 400, "model"),
    (b"[" * 50000, {}, 400, None),
    (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, None),
    (b'{"model": "tiny", "prompt": ' + b"[" * 500 + b"]" * 500 + b"}", {}, 400, "prompt"),
    (b"\xff\xfe\x00garbage", {}, 400, None),
    (b"", {}, 400, None),
    (b'{"model": "tiny", "prompt": [10]}', {"Content-Type": "text/plain"}, 415, "Content-Type"),
    (b'{"model": "tiny", "prompt": [10]}', {"Authorization": "Bearer wrong"}, 401, None),
    (b"x" * 70000, {}, 413, None),
]


def test_a_sweep_of_bad_requests_is_all_4xx_naming_the_field(server):
    for raw, extra, status, param in _BAD:
        headers = {"Content-Type": "application/json", **AUTH, **extra}
        r = httpx.post(server.url + "/v1/completions", content=raw, headers=headers,
                       timeout=30)
        shown = raw[:60]
        assert r.status_code == status, (shown, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (shown, err)
        if param is not None:
            assert (err["param"] or "").startswith(param), (shown, err)
    r = httpx.put(server.url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["allow"], r.text
    _normal(server)
    _settled(server)


def test_clients_that_vanish_mid_request_leave_nothing_behind(server):
    body = json.dumps({"model": "tiny", "prompt": [10, 11], "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    for cut in (len(head) // 2, len(head) + len(body) // 2, len(head) + len(body)):
        s = _connect(server)
        s.sendall((head + body)[:cut])
        if cut == len(head) + len(body):
            s.recv(100)  # the stream has begun
        s.close()
    _normal(server)
    _settled(server)


def test_sigterm_answers_a_body_still_arriving_and_exits_on_time():
    timeout = 3.0
    srv = Server("tiny", "--max-batch", "4", "--shutdown-timeout", str(timeout),
                 "--timeout-body", "60")
    try:
        s = _connect(srv)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
        time.sleep(0.3)
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        raw, _ = _read_all(s)
        s.close()
        code = srv.proc.wait(timeout + 10)
        assert time.monotonic() - t < timeout + 2
        assert code == 0, srv.output()
        status, err = _status_and_error(raw)
        assert status == 503 and err["code"] == "shutting_down", raw
        assert "Traceback" not in srv.output(), srv.output()
    finally:
        srv.stop()


def test_the_read_timeouts_are_checked_at_start():
    import subprocess
    import sys
    for flag in ("--timeout-headers", "--timeout-body", "--timeout-keep-alive"):
        r = subprocess.run([sys.executable, "-m", "graphexec.serve", "--model", "tiny",
                            flag, "0"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and re.search(r"timeout|positive", r.stderr), r.stderr
