"""The server under requests that are costly to take in, as a real process on real sockets:
one client's work must not stall the others."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from test_server import MODEL, Server

httpx = pytest.importorskip("httpx")

CONTEXT = 8192  # a long context: a prompt of a megabyte is within reach, and so tokenised


@pytest.fixture(scope="module")
def server():
    srv = Server(MODEL, "--max-batch", "4", "--max-model-len", str(CONTEXT),
                 "--num-kv-blocks", str(CONTEXT // 16 + 8))
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


def _body(path: str, text: str) -> dict:
    return ({"model": MODEL, "prompt": text} if path == "/v1/completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": text}]})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_prompt_does_not_stall_health(server, path):
    """A prompt near the most characters the context could take is tokenised (seconds, in a
    worker thread) before it is refused; /health keeps answering throughout."""
    if MODEL == "tiny":
        pytest.skip("needs a model with a tokenizer")
    longest = 81  # SmolLM2's longest vocabulary entry, in characters
    text = "hello world, this is a prompt. " * (2 * longest * CONTEXT // 31 - 100)
    busy = threading.Event()
    busy.set()
    probes: list[float] = []
    prober = threading.Thread(target=lambda: probes.extend(_health_while(server.url, busy)))
    t = time.perf_counter()
    prober.start()
    try:
        r = httpx.post(server.url + path, json=_body(path, text), timeout=120)
        took = time.perf_counter() - t
    finally:
        busy.clear()
        prober.join()
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "tokens long" in err["message"], err
    # The refusal takes the whole tokenising time; /health keeps answering throughout it.
    assert len(probes) >= 3, (took, probes)
    assert max(probes) < took / 4, (took, max(probes))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_far_past_the_context_is_refused_untokenised(server, path):
    text = "hello world, this is a prompt. " * (5_000_000 // 31)
    r = httpx.post(server.url + path, json=_body(path, text), timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert "characters long" in err["message"] and err["param"] in ("prompt", "messages"), err


@pytest.mark.parametrize("replicas", [1, 2])
def test_repeated_sigterm_keeps_one_deadline(replicas):
    """A SIGTERM every half second: the drain and its deadline start at the first one, so the
    open stream ends with [DONE] (aborted at the shutdown timeout with an error event, or done
    before it; never cut by uvicorn's own cap), and the process is gone within the timeout plus
    3 s. With data-parallel replicas, every one drains."""
    timeout = 3.0
    srv = Server("tiny", "--max-batch", "4", "--shutdown-timeout", str(timeout),
                 "--data-parallel-size", str(replicas))
    body = {"model": "tiny", "prompt": [10, 11, 12, 13], "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    done = threading.Event()
    first: list[float] = []

    def signal_repeatedly() -> None:
        while not done.is_set() and srv.proc.poll() is None and (
                not first or time.monotonic() - first[0] < 10):
            srv.proc.send_signal(signal.SIGTERM)
            first.append(time.monotonic())
            done.wait(0.5)

    sender = threading.Thread(target=signal_repeatedly)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            sender.start()
            ends = [ln for ln in lines if ln.startswith("data: ")]
        code = srv.proc.wait(timeout + 10)
        exited = time.monotonic() - first[0]
        done.set()
        sender.join()
        assert code == 0, srv.output()
        assert ends[-1] == "data: [DONE]", ends[-3:]
        # Aborted at the deadline, or (on a fast machine) finished before it: never cut short.
        last = json.loads(ends[-2][6:])
        assert ("error" in last and last["error"]["code"] == "shutting_down") or any(
            c.get("finish_reason") == "length" for c in last.get("choices", [])), ends[-3:]
        assert len(first) >= 4  # more signals came while the stream was draining
        # A deadline restarted by each signal would end past the 10 s of signals; 3 s past the
        # timeout leaves room for two replicas' exits on a loaded 2-core machine (5.08 s seen).
        assert exited < timeout + 3, exited
        assert "Traceback" not in srv.output(), srv.output()
    finally:
        done.set()
        srv.stop()
