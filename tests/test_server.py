"""The OpenAI-compatible server (graphexec/serve), as a real process driven by the openai client.

One server (SmolLM2-135M-Instruct on the CPU, started with an API key) serves every test but the
last, which starts a tiny random-weight one to check that SIGTERM ends it cleanly mid-stream.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

# The server's own dependencies: make install-test puts them here; the device machine has none.
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = os.environ.get("GRAPHEXEC_SERVE_TEST_MODEL", "smollm2-135m")
KEY = "sk-test-graphexec"
MAX_MODEL_LEN = 512


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *extra: str, timeout: float = 120.0, device: str = "cpu"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "graphexec.serve", "--model", model, "--device", device,
               "--port", str(self.port), *extra]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"the server was not healthy within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-6000:]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} is not in /metrics"
        return float(m.group(1))

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    srv = Server(MODEL, "--api-key", KEY, "--max-batch", "16", "--max-model-len",
                 str(MAX_MODEL_LEN), "--num-kv-blocks", "160", "--max-queue", "64")
    yield srv
    code = srv.stop()
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{srv.output()}"
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def has_text(server):
    return MODEL != "tiny"  # the tiny preset has no tokenizer: token ids only


def _ids(n: int, start: int = 10) -> list[int]:
    return [start + i for i in range(n)]


def test_models_and_health(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streamed_chat_answers_paris(client, has_text):
    if not has_text:
        pytest.skip("needs a model with a tokenizer and chat template")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += c.delta.role == "assistant"
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert "Paris" in text, text
    assert roles == 1 and finish in ("stop", "length")
    assert usage is not None and 0 < usage.completion_tokens <= 16 and usage.prompt_tokens > 5


def test_chat_n_choices_with_logprobs(client, has_text):
    if not has_text:
        pytest.skip("needs a model with a tokenizer and chat template")
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], temperature=0,
        max_completion_tokens=4, n=2, logprobs=True, top_logprobs=2)
    a, b = out.choices
    assert a.message.content and a.message.content == b.message.content  # greedy: n equal
    assert out.usage.completion_tokens == len(a.logprobs.content) + len(b.logprobs.content)
    assert all(len(t.top_logprobs) == 2 for t in a.logprobs.content)
    if a.finish_reason == "length":  # (a stop token has a logprob but adds no text)
        assert "".join(t.token for t in a.logprobs.content) == a.message.content


def test_completions_text_stop_string_and_token_ids(client, has_text):
    """Three completions at once (one batch, one run's worth of steps on the CPU)."""
    text = dict(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", max_tokens=12, temperature=0)
    asks = [dict(model=MODEL, prompt=_ids(6), max_tokens=5, temperature=0,
                 extra_body={"ignore_eos": True, "return_token_ids": True})]
    if has_text:
        asks += [text, {**text, "stop": [" 9"]}]
    with ThreadPoolExecutor(len(asks)) as pool:
        outs = list(pool.map(lambda ask: client.completions.create(**ask), asks))
    ids = outs[0]
    assert ids.choices[0].finish_reason == "length"
    assert len(ids.choices[0].model_extra["token_ids"]) == 5
    assert ids.usage.prompt_tokens == 6 and ids.usage.completion_tokens == 5
    if has_text:
        full, cut = outs[1].choices[0], outs[2].choices[0]
        assert " 9" in full.text, full.text  # the premise: the model counts on
        assert 0 < outs[1].usage.completion_tokens <= 12
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(" 9")]


def test_sixteen_concurrent_streams(client):
    lengths = [2 + i % 4 for i in range(16)]
    results: list = [None] * 16

    def run(i: int) -> None:
        stream = client.completions.create(
            model=MODEL, prompt=_ids(4 + i, start=20 + i), max_tokens=lengths[i],
            temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens, finish, usage = [], None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                tokens += c.model_extra["token_ids"]
                finish = c.finish_reason or finish
        results[i] = (tokens, finish, usage)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for i, r in enumerate(results):
        assert r is not None, f"stream {i} did not finish"
        tokens, finish, usage = r
        assert len(tokens) == lengths[i] == usage.completion_tokens and finish == "length"
        assert usage.prompt_tokens == 4 + i


BAD = {
    "negative max_tokens": ({"max_tokens": -3}, "max_tokens"),
    "prompt over the context": ({"prompt": _ids(MAX_MODEL_LEN)}, "prompt"),
    "prompt + max_tokens over the context": ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    "temperature": ({"temperature": -0.5}, "temperature"),
    "top_p": ({"top_p": 1.5}, "top_p"),
    "logprobs": ({"logprobs": 99}, "logprobs"),
    "token id outside the vocabulary": ({"prompt": [10, 10**9]}, "prompt"),
    "boolean token ids": ({"prompt": [True, False]}, "prompt"),
    "float token id": ({"prompt": [10, 1.5]}, "prompt"),
    "float token id in a batch": ({"prompt": [[10], [1.5]]}, "prompt"),
    "empty stop string": ({"stop": ""}, "stop"),
    "empty stop string in a list": ({"stop": ["a", ""]}, "stop"),
    "n": ({"n": 0}, "n"),
    "top_k": ({"extra_body": {"top_k": -7}}, "top_k"),
    # These two pass the handler's checks and are refused by Engine.add_request on the engine
    # thread: the same 400, and the loop goes on serving.
    "stop id outside the vocabulary": ({"extra_body": {"stop_token_ids": [10**8]}},
                                       "stop_token_ids"),
    "too many stop ids under min_tokens": (
        {"extra_body": {"min_tokens": 1, "stop_token_ids": list(range(3, 40))}},
        "stop_token_ids"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_completion_is_400_naming_the_field(client, case):
    change, param = BAD[case]
    ask = {"model": MODEL, "prompt": _ids(4), "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**ask)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param.split("_")[0] in err["message"], err
    assert "cmpl-" not in err["message"], err  # no internal request ids
    if "token id" in case and "vocabulary" not in case:
        assert "expected an integer token id" in err["message"], err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=_ids(3), max_tokens=1)
    err = e.value.body
    assert e.value.status_code == 404 and err["code"] == "model_not_found", err
    assert err["param"] == "model", err


def test_bearer_scheme_is_case_insensitive_and_405_says_allow(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "POST" in r.headers["allow"], r.headers
    assert r.json()["error"]["code"] == "405", r.text


def test_bad_chat_fields_are_named(client, has_text):
    if not has_text:
        pytest.skip("needs a model with a chat template")
    msgs = [{"role": "user", "content": "hi"}]
    for change, param in (({"max_completion_tokens": 0}, "max_completion_tokens"),
                          ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
                          ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
                          ({"messages": []}, "messages"),
                          ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{"model": MODEL, "messages": msgs, **change})
        assert e.value.body["param"] == param, e.value.body


def test_bad_json_is_400_and_the_server_still_serves(server, client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": ', headers=auth)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(
        {"model": MODEL, "prompt": _ids(3), "max_tokens": "many"}), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    out = client.completions.create(model=MODEL, prompt=_ids(3), max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def _post(server: Server, path: str, raw: str) -> httpx.Response:
    return httpx.post(server.url + path, content=raw.encode(), timeout=30, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})


def test_text_that_is_not_unicode_is_400_naming_the_field(server, has_text):
    if not has_text:
        pytest.skip("needs a model with a tokenizer")
    # A lone surrogate is valid JSON but no valid text: written raw, as a client could.
    for path, raw, param in (
            ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "a\\ud800"}}', "prompt"),
            ("/v1/completions", f'{{"model": "{MODEL}", "prompt": ["ok", "\\udc00"]}}',
             "prompt"),
            ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "a", "stop": "\\ud800"}}',
             "stop"),
            ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", '
             f'"content": "\\ud800"}}]}}', "messages[0].content")):
        r = _post(server, path, raw)
        assert r.status_code == 400, (raw, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "Unicode" in err["message"], err
        assert err["type"] == "invalid_request_error", err


def test_a_request_larger_than_the_queue_is_400_not_503(client):
    # The fixture's --max-queue is 64: no wait makes room for 65 requests at once.
    for prompts, n in (([_ids(2)] * 65, 1), ([_ids(2)] * 5, 16)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompts, n=n, max_tokens=1)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == "prompt", err
        assert "max_queue=64" in err["message"], err


def test_hang_up_mid_stream_frees_the_request(server, client):
    body = {"model": MODEL, "prompt": _ids(8), "max_tokens": 400, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break
    assert server.metric("graphexec_requests_running") <= 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (server.metric("graphexec_requests_running") == 0
                and server.metric("graphexec_kv_blocks_used") == 0):
            break
        time.sleep(0.05)
    assert server.metric("graphexec_requests_running") == 0
    assert server.metric("graphexec_kv_blocks_used") == 0
    assert server.metric('graphexec_requests_finished_total{finish_reason="abort"}') >= 1
    out = client.completions.create(model=MODEL, prompt=_ids(3), max_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_api_key_is_required(server):
    anon = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    with pytest.raises(openai.AuthenticationError):
        anon.completions.create(model=MODEL, prompt=_ids(3), max_tokens=2)
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_count_tokens_and_latency(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("graphexec_requests_running", "graphexec_requests_waiting",
                 "graphexec_kv_blocks_used", "graphexec_kv_blocks_total",
                 "graphexec_generation_tokens_total", "graphexec_engine_pauses_total",
                 "graphexec_engine_evictions_total",
                 "graphexec_time_to_first_token_seconds_count",
                 "graphexec_inter_token_latency_seconds_count"):
        assert re.search(rf"^{name} ", text, re.M), name
    assert server.metric("graphexec_kv_blocks_total") == 160
    assert server.metric("graphexec_generation_tokens_total") > 16
    assert server.metric("graphexec_time_to_first_token_seconds_count") >= 16


def _long_stream_ends(srv: Server, interrupt) -> list[str]:
    """Starts a 1500-token stream on a tiny server, calls interrupt() once its first chunk
    came, and returns the `data:` lines that followed (the stream must end, not hang)."""
    body = {"model": "tiny", "prompt": _ids(4), "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        interrupt()
        return [ln for ln in lines if ln.startswith("data: ")]


def test_sigterm_mid_stream_ends_cleanly():
    srv = Server("tiny", "--max-batch", "4", "--shutdown-timeout", "1")
    try:
        ends = _long_stream_ends(srv, lambda: srv.proc.send_signal(signal.SIGTERM))
        assert srv.proc.wait(30) == 0, srv.output()
        # aborted after the grace period (1 s, far less than 1500 tokens take) and told so
        assert ends[-1] == "data: [DONE]"
        assert json.loads(ends[-2][6:])["error"]["code"] == "shutting_down"
        assert "Traceback" not in srv.output(), srv.output()
    finally:
        srv.stop()


def _spawned_children(pid: int) -> list[int]:
    """The children of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)],
                         capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "multiprocessing.spawn" in line]


def _engine_process(server_pid: int) -> int:
    """The pid of the server's engine process."""
    pids = _spawned_children(server_pid)
    assert len(pids) == 1, pids
    return pids[0]


def test_engine_process_death_fails_open_streams_and_exits():
    srv = Server("tiny", "--max-batch", "4")
    try:
        ends = _long_stream_ends(
            srv, lambda: os.kill(_engine_process(srv.proc.pid), signal.SIGKILL))
        assert ends[-1] == "data: [DONE]"
        assert "engine" in json.loads(ends[-2][6:])["error"]["message"]
        assert srv.proc.wait(30) == 1, srv.output()  # the server does not outlive its engine
        assert "the engine failed" in srv.output()
    finally:
        srv.stop()


def test_tensor_parallel_server_answers_as_one_rank_does():
    from graphexec import LLM, SamplingParams

    prompt, n = _ids(6, start=40), 12
    with LLM("tiny", device="cpu", max_batch=4) as llm:
        expected = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                         ignore_eos=True))[0].token_ids
    srv = Server("tiny", "--tensor-parallel-size", "2", "--max-batch", "4")
    try:
        out = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}).json()
        assert out["choices"][0]["token_ids"] == list(expected)
        workers = _spawned_children(_engine_process(srv.proc.pid))
        assert len(workers) == 1  # the engine process started rank 1
        assert srv.stop() == 0, srv.output()
        with pytest.raises(ProcessLookupError):  # and SIGTERM to the server ended it too
            for _ in range(100):
                os.kill(workers[0], 0)
                time.sleep(0.1)
    finally:
        srv.stop()
