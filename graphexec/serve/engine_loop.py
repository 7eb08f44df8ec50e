"""The HTTP process's handle on the engine process (engine_core.py).

The event loop calls submit / abort / drain, which never block: commands go into an outbox that
a writer thread sends down the pipe (a plain queue put is also safe from a signal handler). A
reader thread receives each iteration's message, keeps the counters, and hands the events to
their requests' sinks with one call_soon_threadsafe per iteration. A slow reader of a
stream only lets its own sink grow (generation.py merges what piled up into one chunk).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine_core import EngineSnapshot, run_engine_process
from .events import Abort, Add, Admitted, Drain, Event, Rejected, Sink, Stop
from .model_info import ModelInfo

log = logging.getLogger("graphexec.serve")

__all__ = ["EngineLoop", "EngineSnapshot", "Phase"]


class Phase(enum.Enum):
    STARTING = "starting"  # building the engine (loading weights, capturing graphs)
    SERVING = "serving"
    STOPPING = "stopping"  # aborting what is left
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(slots=True)
class _Route:
    """Where a request's events go, and whether the engine has answered its Add yet."""

    sink: Sink
    index: int  # the choice it is (an HTTP request with n choices routes n engine requests)
    answered: bool = False


Observer = Callable[[Sink, Event, float], None]


class EngineLoop:
    def __init__(self, factory: Callable[[], object], observer: Observer | None = None,
                 on_fatal: Callable[[], None] | None = None, log_level: str = "INFO"):
        self._factory = factory  # runs in the engine process: it must pickle
        self.observer = observer  # called on the event loop for each event handed over
        self.on_fatal = on_fatal  # called on the reader thread if the engine fails
        self._log_level = log_level
        self.phase = Phase.STARTING
        self.info: ModelInfo | None = None
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # Guards _routes, _pending and _closed: once closed, nothing more may be submitted
        # (it would wait for an answer from an engine that is gone).
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._pending = 0  # Adds the engine has not answered yet
        self._closed = False
        self._aio: asyncio.AbstractEventLoop | None = None
        self._process: mp.process.BaseProcess | None = None
        self._threads: list[threading.Thread] = []

    # -- the event loop's side ----------------------------------------------------------------

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        ev_read, ev_write = ctx.Pipe(duplex=False)
        # Not a daemon: the engine may start processes of its own (tensor-parallel workers).
        # It ends when told to, or when it reads EOF because this process is gone.
        self._process = ctx.Process(target=run_engine_process, name="graphexec-engine",
                                    args=(self._factory, cmd_read, ev_write, self._log_level))
        self._process.start()
        cmd_read.close()  # the child's ends: EOF reaches each side once the other is gone
        ev_write.close()
        self._threads = [
            threading.Thread(target=self._write, args=(cmd_write,), name="graphexec-commands",
                             daemon=True),
            threading.Thread(target=self._read, args=(ev_read,), name="graphexec-events",
                             daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    def num_waiting(self) -> int:
        """Requests accepted but not running yet: on their way to the engine or queued in it."""
        return self._pending + self.snapshot.waiting

    def submit(self, request_id: str, prompt: list[int], params, sink: Sink, index: int) -> None:
        """Non-blocking. The answer (Admitted or Rejected) arrives at the sink."""
        with self._lock:
            if not self._closed:
                self._pending += 1
                self._routes[request_id] = _Route(sink, index)
                self._outbox.put(Add(request_id, prompt, params, index))
                return
        sink.put(Rejected(index, "the server is shutting down", 503))

    def abort(self, request_id: str) -> None:
        """Non-blocking; a request that already ended is left alone."""
        self._outbox.put(Abort(request_id))

    def drain(self, grace: float) -> None:
        """Safe from a signal handler (SimpleQueue.put is reentrant)."""
        self._outbox.put(Drain(grace))

    def stop(self, timeout: float | None = None) -> None:
        """Blocking: the engine aborts what is left and closes; the process is joined."""
        if self.phase is Phase.SERVING:
            self.phase = Phase.STOPPING
        self._outbox.put(Stop())
        for t in self._threads:
            t.join(timeout)
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                log.warning("the engine process did not end in time: killing it")
                self._process.kill()
                self._process.join()

    # -- the writer and reader threads ----------------------------------------------------------

    def _write(self, conn) -> None:
        try:
            while True:
                cmd = self._outbox.get()
                conn.send(cmd)
                if isinstance(cmd, Stop):
                    break
        except (OSError, ValueError):
            pass  # the engine process is gone; the reader reports it
        finally:
            conn.close()

    def _read(self, conn) -> None:
        try:
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "ready":
                    self.info, self.snapshot = msg[1], msg[2]
                    self.phase = Phase.SERVING
                    log.info("engine ready: max_model_len=%d, %d KV blocks",
                             self.info.max_model_len, self.info.kv_blocks)
                elif kind == "events":
                    self.snapshot = msg[2]
                    self._deliver(self._route(msg[1]))
                elif kind == "stopped":
                    self.phase = Phase.STOPPED
                    self._refuse_rest("the server is shutting down", 503)
                    return
                elif kind == "failed":
                    self._fail(RuntimeError(msg[1]))
                    return
        except (EOFError, OSError) as e:
            code = self._process.exitcode if self._process is not None else None
            self._fail(RuntimeError(f"the engine process ended unexpectedly (exit code "
                                    f"{code}): {type(e).__name__}"))
        finally:
            conn.close()

    def _route(self, events: list[tuple[str, Event]]) -> list[tuple[Sink, Event]]:
        out = []
        with self._lock:
            for rid, ev in events:
                route = self._routes.get(rid)
                if route is None:
                    continue
                if isinstance(ev, (Admitted, Rejected)) and not route.answered:
                    route.answered = True
                    self._pending -= 1
                if isinstance(ev, Rejected) or getattr(ev, "finish_reason", None) is not None:
                    del self._routes[rid]
                out.append((route.sink, ev))
        return out

    def _deliver(self, events: list[tuple[Sink, Event]]) -> None:
        if not events or self._aio is None:
            return
        try:  # one wake-up of the event loop per iteration, whatever the batch size
            self._aio.call_soon_threadsafe(self._hand_over, events)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to read them

    def _hand_over(self, events: list[tuple[Sink, Event]]) -> None:
        now = time.monotonic()
        for sink, ev in events:
            sink.put(ev)
            if self.observer is not None:
                self.observer(sink, ev, now)

    def _refuse_rest(self, message: str, status: int) -> None:
        """Every request still routed gets Rejected, and nothing more is accepted."""
        with self._lock:
            self._closed = True
            rest = [(r.sink, Rejected(r.index, message, status)) for r in self._routes.values()]
            self._routes.clear()
            self._pending = 0
        self._deliver(rest)

    def _fail(self, error: BaseException) -> None:
        log.error("the engine failed: %s", error)
        self.error = error
        self.phase = Phase.FAILED
        self._refuse_rest(f"the engine failed: {error}", 500)
        if self.on_fatal is not None:
            self.on_fatal()

