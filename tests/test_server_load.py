"""The server under requests that are costly to take in, as a real process on real sockets:
one client's work must not stall the others."""
from __future__ import annotations

import threading
import time

import pytest

from test_server import MODEL, Server

httpx = pytest.importorskip("httpx")

PROMPT_BYTES = 3_000_000  # seconds of tokenising on the CPU, far past the context


@pytest.fixture(scope="module")
def server():
    srv = Server(MODEL, "--max-batch", "4", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0, srv.output()


def _health_while(url: str, busy: threading.Event) -> list[float]:
    """/health latencies, one probe after another, for as long as `busy` is set."""
    latencies = []
    while busy.is_set():
        t = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - t)
        time.sleep(0.02)
    return latencies


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_prompt_does_not_stall_health(server, path):
    if MODEL == "tiny":
        pytest.skip("needs a model with a tokenizer")
    text = "hello world, this is a prompt. " * (PROMPT_BYTES // 31)
    body = ({"model": MODEL, "prompt": text} if path == "/v1/completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    busy = threading.Event()
    busy.set()
    probes: list[float] = []
    prober = threading.Thread(target=lambda: probes.extend(_health_while(server.url, busy)))
    t = time.perf_counter()
    prober.start()
    try:
        r = httpx.post(server.url + path, json=body, timeout=120)
        took = time.perf_counter() - t
    finally:
        busy.clear()
        prober.join()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    # The refusal takes the whole tokenising time; /health keeps answering throughout it.
    assert len(probes) >= 3, (took, probes)
    assert max(probes) < took / 4, (took, max(probes))
