"""The one thread that owns the Engine: every Engine call happens on it.

Each iteration: take what the inbox holds (blocking only when the engine has nothing to do),
apply it (add, abort), step, and hand the step's outputs to their requests' queues with one
call_soon_threadsafe. Handing over never waits for a client: a slow reader only lets its own
asyncio.Queue grow, and the thread goes straight on to the next step. Conversely the event loop
never waits for a step: it puts commands in the inbox and awaits its queue.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .events import Abort, Add, Admitted, Delta, Drain, Event, Rejected, Sink, Stop
from .model_info import ModelInfo

log = logging.getLogger("graphexec.serve")


class Phase(enum.Enum):
    STARTING = "starting"  # building the engine (loading weights, capturing graphs)
    SERVING = "serving"
    STOPPING = "stopping"  # aborting what is left
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after an iteration, published for /metrics and admission. Replaced
    whole (one reference assignment), so a reader on another thread sees one consistent set."""

    running: int = 0
    waiting: int = 0  # queued in the engine, paused requests included
    paused: int = 0
    kv_used: int = 0
    kv_total: int = 0
    steps: int = 0
    tokens: int = 0
    pauses: int = 0
    evictions: int = 0
    chain_breaks: int = 0
    batch_rows: int = 0  # rows over all launched steps (mean batch = batch_rows / steps)
    cached_blocks: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        s = engine.stats_summary()
        return cls(running=s["running"], waiting=s["waiting"] + s["paused"], paused=s["paused"],
                   kv_used=s["kv_used"], kv_total=s["kv_total"], steps=s["steps"],
                   tokens=s["tokens"], pauses=s["pauses"], evictions=s["evictions"],
                   chain_breaks=s["chain_breaks"], batch_rows=s["batch_rows"],
                   cached_blocks=s["cached_blocks"],
                   prefix_query_tokens=s["prefix_query_tokens"],
                   prefix_hit_tokens=s["prefix_hit_tokens"])


@dataclass(slots=True)
class _Live:
    """An admitted request the thread still owes outputs to."""

    sink: Sink
    index: int
    wants_logprobs: bool
    num_tokens: int = 0


Observer = Callable[[Sink, Event, float], None]


class EngineLoop:
    def __init__(self, factory: Callable[[], object], observer: Observer | None = None,
                 on_fatal: Callable[[], None] | None = None):
        self._factory = factory
        self.observer = observer  # called on the event loop for each event handed over
        self.on_fatal = on_fatal  # called on the engine thread if the engine fails
        self.phase = Phase.STARTING
        self.info: ModelInfo | None = None
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Guards _pending and _closed: once closed, nothing more may enter the inbox (it
        # would wait for an answer from a thread that is gone).
        self._lock = threading.Lock()
        self._pending = 0  # Adds in the inbox, not yet seen by the thread
        self._closed = False
        self._abort_at: float | None = None  # set by Drain
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the event loop's side ----------------------------------------------------------------

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self._thread = threading.Thread(target=self._main, name="graphexec-engine", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    def num_waiting(self) -> int:
        """Requests accepted but not running yet: in the inbox or queued in the engine."""
        return self._pending + self.snapshot.waiting

    def submit(self, request_id: str, prompt: list[int], params, sink: Sink, index: int) -> None:
        """Non-blocking. The answer (Admitted or Rejected) arrives on sink.queue."""
        with self._lock:
            if not self._closed:
                self._pending += 1
                self._inbox.put(Add(request_id, prompt, params, sink, index))
                return
        sink.queue.put_nowait(Rejected(index, "the server is shutting down", 503))

    def abort(self, request_id: str) -> None:
        """Non-blocking; a request that already ended is left alone."""
        self._inbox.put(Abort(request_id))

    def drain(self, grace: float) -> None:
        """Safe from a signal handler (SimpleQueue.put is reentrant)."""
        self._inbox.put(Drain(grace))

    def stop(self, timeout: float | None = None) -> None:
        """Blocking: aborts what is left, closes the engine and joins the thread."""
        self._inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------

    def _main(self) -> None:
        try:
            engine = self._factory()
            self.info = ModelInfo.of(engine)
            self.snapshot = EngineSnapshot.of(engine)
        except BaseException as e:  # noqa: BLE001 -- reported through phase and error
            log.exception("the engine failed to start")
            self._fail(e, {})
            return
        self.phase = Phase.SERVING
        log.info("engine ready: max_model_len=%d, %d KV blocks", self.info.max_model_len,
                 self.info.kv_blocks)
        live: dict[str, _Live] = {}
        try:
            self._serve(engine, live)
            self.phase = Phase.STOPPED
        except BaseException as e:  # noqa: BLE001
            log.exception("the engine loop failed")
            self._fail(e, live)
        finally:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 -- closing is best effort on the way out
                log.exception("closing the engine failed")

    def _serve(self, engine, live: dict[str, _Live]) -> None:
        while True:
            events: list[tuple[Sink, Event]] = []
            commands = self._take(block=not engine.has_unfinished())
            stop = self._apply(engine, commands, live, events)
            if stop:
                self._deliver(events)
                break
            if self._abort_at is not None and time.monotonic() >= self._abort_at:
                self._abort_at = None
                for rid in list(live):
                    self._abort(engine, rid)
            if engine.has_unfinished():
                self._step(engine, live, events)
            self.snapshot = EngineSnapshot.of(engine)
            self._deliver(events)
        self.phase = Phase.STOPPING
        self._close_inbox()
        for rid in list(live):
            self._abort(engine, rid)
        while engine.has_unfinished():
            events = []
            self._step(engine, live, events)
            self._deliver(events)
        self.snapshot = EngineSnapshot.of(engine)

    def _take(self, block: bool) -> list:
        # Idle: sleep on the inbox until a command comes (no polling). Busy: take whatever is
        # there without waiting, and step.
        items = [self._inbox.get()] if block else []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _apply(self, engine, commands: list, live: dict[str, _Live],
               events: list[tuple[Sink, Event]]) -> bool:
        stop = False
        for cmd in commands:
            if isinstance(cmd, Add):
                with self._lock:
                    self._pending -= 1
                if stop:
                    events.append((cmd.sink, Rejected(cmd.index, "the server is shutting down",
                                                      503)))
                    continue
                events.append((cmd.sink, self._add(engine, cmd, live)))
            elif isinstance(cmd, Abort):
                if cmd.request_id in live:
                    self._abort(engine, cmd.request_id)
            elif isinstance(cmd, Drain):
                self._abort_at = time.monotonic() + cmd.grace
            elif isinstance(cmd, Stop):
                stop = True
        return stop

    def _add(self, engine, cmd: Add, live: dict[str, _Live]) -> Event:
        try:
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except ValueError as e:  # validation the handler could not do: refuse this one only
            return Rejected(cmd.index, str(e), 400)
        except Exception as e:  # noqa: BLE001 -- one bad request must not end the loop
            log.exception("add_request(%s) failed", cmd.request_id)
            return Rejected(cmd.index, f"the engine could not take the request: {e}", 500)
        live[cmd.request_id] = _Live(cmd.sink, cmd.index, cmd.params.logprobs is not None)
        return Admitted(cmd.index)

    @staticmethod
    def _abort(engine, request_id: str) -> None:
        try:
            engine.abort(request_id)
        except ValueError:
            pass  # it ended in the same step the client left: nothing to free

    @staticmethod
    def _step(engine, live: dict[str, _Live], events: list[tuple[Sink, Event]]) -> None:
        for out in engine.step():
            lv = live.get(out.request_id)
            if lv is None:
                continue
            new = out.new_token_ids  # a fresh list per output: safe to hand to another thread
            lv.num_tokens += len(new)
            lps = out.logprobs[-len(new):] if lv.wants_logprobs and new else None
            if out.finished:
                del live[out.request_id]
            events.append((lv.sink, Delta(lv.index, new, out.new_text or "",
                                          lps, out.finish_reason, lv.num_tokens)))

    def _deliver(self, events: list[tuple[Sink, Event]]) -> None:
        if not events or self._aio is None:
            return
        try:  # one wake-up of the event loop per step, whatever the batch size
            self._aio.call_soon_threadsafe(self._hand_over, events)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to read them

    def _hand_over(self, events: list[tuple[Sink, Event]]) -> None:
        now = time.monotonic()
        for sink, ev in events:
            sink.queue.put_nowait(ev)
            if self.observer is not None:
                self.observer(sink, ev, now)

    def _close_inbox(self) -> None:
        """Refuses whatever is still in the inbox, and anything submitted later."""
        with self._lock:
            self._closed = True
        events: list[tuple[Sink, Event]] = []
        for cmd in self._take(block=False):
            if isinstance(cmd, Add):
                with self._lock:
                    self._pending -= 1
                events.append((cmd.sink, Rejected(cmd.index, "the server is shutting down",
                                                  503)))
        self._deliver(events)

    def _fail(self, error: BaseException, live: dict[str, _Live]) -> None:
        self.error = error
        self.phase = Phase.FAILED
        self._deliver([(lv.sink, Rejected(lv.index, f"the engine failed: {error}", 500))
                       for lv in live.values()])
        live.clear()
        self._close_inbox()
        if self.on_fatal is not None:
            self.on_fatal()
