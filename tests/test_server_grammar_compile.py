"""The engine process compiles a request's grammar off its loop (serve/engine_core.py): while one
request's grammar compiles, the others are admitted and stream to the end; a grammar that does
not compile is a 400 naming the compiler's complaint; a request aborted while its grammar
compiles is never admitted; a stop refuses what still compiles. SmolLM2 on the CPU, the loop
driven through its inbox as the HTTP process drives it."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("xgrammar")

from graphexec import Engine, SamplingParams  # noqa: E402
from graphexec.serve.engine_core import EngineCore  # noqa: E402
from graphexec.serve.events import Abort, Add, Admitted, Delta, Rejected, Stop  # noqa: E402
from graphexec.structured import StructuredOutputsParams as S  # noqa: E402

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


class _Loop:
    """An EngineCore serving on a thread; what it sends is kept, by request id."""

    def __init__(self, engine: Engine):
        self.sent: list = []
        self.core = EngineCore(engine, self.sent.append)
        self.thread = threading.Thread(target=self.core.serve, daemon=True)
        self.thread.start()

    def add(self, rid: str, params: SamplingParams, index: int = 0) -> None:
        prompt = self.core.engine.tokenizer.encode("A JSON answer:", add_special_tokens=True)
        self.core.inbox.put(Add(rid, prompt, params, index))

    def events(self, rid: str) -> list:
        return [ev for msg in list(self.sent) if msg[0] == "events"
                for r, ev in msg[1] if r == rid]

    def finished(self, rid: str) -> bool:
        return any(isinstance(ev, Delta) and ev.finish_reason for ev in self.events(rid))

    def wait(self, cond, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def stop(self) -> None:
        self.core.inbox.put(Stop())
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()


def _hold_compiles(engine, monkeypatch, held: set[str]) -> threading.Event:
    """Holds the grammar compiles of the request ids in `held` until the returned event is
    set; the others compile at once."""
    release = threading.Event()
    compile_grammar = engine.compile_grammar

    def slow(rid, params):
        if rid in held:
            assert release.wait(120)
        compile_grammar(rid, params)

    monkeypatch.setattr(engine, "compile_grammar", slow)
    return release


@pytest.fixture(scope="module")
def engine():
    e = Engine("smollm2-135m", max_model_len=256, max_batch=4)
    yield e
    e.close()


def test_a_grammar_that_compiles_slowly_stalls_no_other_request(engine, monkeypatch):
    release = _hold_compiles(engine, monkeypatch, {"slow"})
    loop = _Loop(engine)
    try:
        loop.add("slow", SamplingParams(max_tokens=24, structured_outputs=S(json=SCHEMA)))
        loop.add("plain", SamplingParams(max_tokens=16, temperature=0.0), index=1)
        loop.wait(lambda: loop.finished("plain"))
        assert loop.events("slow") == []  # still compiling: neither admitted nor refused
        assert isinstance(loop.events("plain")[0], Admitted)
        release.set()
        loop.wait(lambda: loop.finished("slow"))
        assert isinstance(loop.events("slow")[0], Admitted)
        assert engine._compiled == {}  # add_request took it
    finally:
        release.set()
        loop.stop()


def test_a_grammar_that_does_not_compile_is_a_400_and_an_aborted_one_never_runs(engine,
                                                                                monkeypatch):
    release = _hold_compiles(engine, monkeypatch, {"left"})
    loop = _Loop(engine)
    try:
        loop.add("bad", SamplingParams(max_tokens=8, structured_outputs=S(regex="(unclosed")))
        loop.wait(lambda: loop.events("bad"))
        (ev,) = loop.events("bad")
        assert isinstance(ev, Rejected) and ev.status == 400
        assert "structured_outputs.regex does not compile" in ev.message
        loop.add("left", SamplingParams(max_tokens=8, structured_outputs=S(json=SCHEMA)))
        loop.core.inbox.put(Abort("left"))
        loop.add("after", SamplingParams(max_tokens=4, temperature=0.0))
        loop.wait(lambda: loop.finished("after"))
        release.set()
        loop.wait(lambda: "left" not in engine._compiled and not loop.core._compiling)
        loop.add("after2", SamplingParams(max_tokens=4, temperature=0.0))
        loop.wait(lambda: loop.finished("after2"))  # an iteration after the compile ended
        assert loop.events("left") == []
        assert engine._compiled == {}
    finally:
        release.set()
        loop.stop()


def test_a_stop_refuses_what_still_compiles(engine, monkeypatch):
    release = _hold_compiles(engine, monkeypatch, {"pending"})
    loop = _Loop(engine)
    try:
        loop.add("pending", SamplingParams(max_tokens=8, structured_outputs=S(json=SCHEMA)))
        loop.wait(lambda: "pending" in loop.core._compiling)
        loop.stop()
        (ev,) = loop.events("pending")
        assert isinstance(ev, Rejected) and ev.status == 503
    finally:
        release.set()
