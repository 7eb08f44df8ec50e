"""The HTTP process's handle on the engine process (engine_core.py).

The event loop calls submit / abort / drain, which never block: commands go into an outbox that
a writer thread sends down the pipe (a plain queue put is also safe from a signal handler). The
event loop itself reads the events pipe (frames.py says why not a thread): each iteration's
message updates the counters and puts the events into their requests' sinks. A slow reader of
a stream only lets its own sink grow (generation.py merges what piled up into one chunk).
Everything here but stop() and the writer thread runs on the event loop, so the routes need
no lock.
"""
from __future__ import annotations

import asyncio
import enum
import fcntl
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .engine_core import EngineSnapshot, run_engine_process
from .events import Abort, Add, Admitted, Drain, Event, Rejected, Sink, Stop
from .frames import FrameReader
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
        self.on_fatal = on_fatal  # called on the event loop if the engine fails
        self._log_level = log_level
        self.phase = Phase.STARTING
        self.info: ModelInfo | None = None
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._pending = 0  # Adds the engine has not answered yet
        # Once closed, nothing more may be submitted (it would wait for an answer from an
        # engine that is gone).
        self._closed = False
        self._aio: asyncio.AbstractEventLoop | None = None
        self._process: mp.process.BaseProcess | None = None
        self._writer: threading.Thread | None = None
        self._events = None  # the events pipe's reading end, read on the event loop
        self._frames = FrameReader()
        self._ended = threading.Event()  # the events pipe said its last (stopped, failed, EOF)

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
        self._writer = threading.Thread(target=self._write, args=(cmd_write,),
                                        name="graphexec-commands", daemon=True)
        self._writer.start()
        self._events = ev_read
        os.set_blocking(ev_read.fileno(), False)
        _widen(ev_read.fileno())
        aio_loop.add_reader(ev_read.fileno(), self._on_readable)

    @property
    def serving(self) -> bool:
        return self.phase is Phase.SERVING

    def num_waiting(self) -> int:
        """Requests accepted but not running yet: on their way to the engine or queued in it."""
        return self._pending + self.snapshot.waiting

    def submit(self, request_id: str, prompt: list[int], params, sink: Sink, index: int) -> None:
        """Non-blocking. The answer (Admitted or Rejected) arrives at the sink."""
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
        """Blocking, off the event loop (which goes on reading the engine's last events): the
        engine aborts what is left and closes; the process is joined."""
        if self.phase is Phase.SERVING:
            self.phase = Phase.STOPPING
        self._outbox.put(Stop())
        if self._writer is not None:
            self._writer.join(timeout)
            self._ended.wait(timeout)
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                log.warning("the engine process did not end in time: killing it")
                self._process.kill()
                self._process.join()

    # -- the writer thread, and the events pipe on the event loop ------------------------------

    def _write(self, conn) -> None:
        try:
            while True:
                cmd = self._outbox.get()
                conn.send(cmd)
                if isinstance(cmd, Stop):
                    break
        except (OSError, ValueError):
            pass  # the engine process is gone; the events pipe's EOF reports it
        finally:
            conn.close()

    def _on_readable(self) -> None:
        try:
            data = os.read(self._events.fileno(), 1 << 20)
        except BlockingIOError:
            return
        except OSError as e:
            self._lost(e)
            return
        if not data:
            self._lost(EOFError())
            return
        for msg in self._frames.feed(data):
            if self._ended.is_set():
                return
            self._receive(msg)

    def _receive(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "events":
            self.snapshot = msg[2]
            self._hand_over(self._route(msg[1]))
        elif kind == "ready":
            self.info, self.snapshot = msg[1], msg[2]
            self.phase = Phase.SERVING
            log.info("engine ready: max_model_len=%d, %d KV blocks",
                     self.info.max_model_len, self.info.kv_blocks)
        elif kind == "stopped":
            self._close_events()
            self.phase = Phase.STOPPED
            self._refuse_rest("the server is shutting down", 503)
        elif kind == "failed":
            self._close_events()
            self._fail(RuntimeError(msg[1]))

    def _lost(self, e: BaseException) -> None:
        self._close_events()
        code = self._process.exitcode if self._process is not None else None
        self._fail(RuntimeError(f"the engine process ended unexpectedly (exit code "
                                f"{code}): {type(e).__name__}"))

    def _close_events(self) -> None:
        """The events pipe's last word came: nothing more is read from it."""
        if self._aio is not None and not self._aio.is_closed():
            self._aio.remove_reader(self._events.fileno())
        self._events.close()
        self._ended.set()

    def _route(self, events: list[tuple[str, Event]]) -> list[tuple[Sink, Event]]:
        out = []
        routes = self._routes
        for rid, ev in events:
            route = routes.get(rid)
            if route is None:
                continue
            if isinstance(ev, (Admitted, Rejected)) and not route.answered:
                route.answered = True
                self._pending -= 1
            if isinstance(ev, Rejected) or getattr(ev, "finish_reason", None) is not None:
                del routes[rid]
            out.append((route.sink, ev))
        return out

    def _hand_over(self, events: list[tuple[Sink, Event]]) -> None:
        now = time.monotonic()
        observe = self.observer
        for sink, ev in events:
            sink.put(ev)
            if observe is not None:
                observe(sink, ev, now)

    def _refuse_rest(self, message: str, status: int) -> None:
        """Every request still routed gets Rejected, and nothing more is accepted."""
        self._closed = True
        rest = [(r.sink, Rejected(r.index, message, status)) for r in self._routes.values()]
        self._routes.clear()
        self._pending = 0
        self._hand_over(rest)

    def _fail(self, error: BaseException) -> None:
        log.error("the engine failed: %s", error)
        self.error = error
        self.phase = Phase.FAILED
        self._refuse_rest(f"the engine failed: {error}", 500)
        if self.on_fatal is not None:
            self.on_fatal()


# The events pipe's capacity where Linux allows it (its usual cap, 1 MiB: some fifty
# iterations of 256 requests). The event loop reads it between other work; while a piece of
# that work runs long, the engine goes on stepping into the pipe instead of waiting on it.
_PIPE_BYTES = 1 << 20


def _widen(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or above the system's cap: as it was
        pass
