"""The engine's own process: it builds the Engine and is the only code that ever touches it.

The HTTP process (engine_loop.EngineLoop) and this one share nothing but two one-way pipes:
commands come in (Add, Abort, Drain, Stop), and after every iteration one message goes out with
the events of all the requests the step touched and the engine's counters (framed as frames.py
says). Apart from the HTTP process, the engine's host loop never waits for the Python lock of
an event loop that is parsing requests or writing stream chunks, and the event loop never
waits for a step: at thousands of tokens a second the two together need more than one core.

Each iteration: take what the inbox holds (blocking only when the engine has nothing to do),
apply it, step, and send the step's outputs. A thread of this process moves commands from the
pipe into the inbox, so a step never waits for the pipe either.

A request with structured outputs is admitted once its grammar is compiled, which worker threads
do (xgrammar releases the GIL): a large grammar takes seconds, and compiled on this loop's
thread it would stall every stream meanwhile. A compile that fails refuses the request (400).
"""
from __future__ import annotations

import functools
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection

from .events import Abort, Add, Admitted, Delta, Drain, Event, Rejected, Stop
from .frames import write_frame

log = logging.getLogger("graphexec.serve")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after an iteration, sent with its events for /metrics and
    admission. Replaced whole on the HTTP side (one reference assignment), so a reader there
    sees one consistent set."""

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
        """Each field is the stats_summary() entry of its name, waiting counting paused too."""
        s = engine.stats_summary()
        values = {f.name: s[f.name] for f in fields(cls)}
        values["waiting"] += s["paused"]
        return cls(**values)


# Messages to the HTTP process, as tuples (cheap to pickle), one frame each (frames.py):
#   ("ready", ModelInfo, EngineSnapshot)   the engine is built; serving from now on
#   ("events", [(request_id, Event)], EngineSnapshot)   one iteration's outputs
#   ("failed", message)   the engine failed to start, or its loop failed; the process ends
#   ("stopped",)   a Stop was carried out: every request aborted, the engine closed
Outbound = tuple


@dataclass(slots=True)
class _Live:
    """An admitted request the loop still owes outputs to."""

    index: int
    wants_logprobs: bool
    num_tokens: int = 0
    wants_prompt_logprobs: bool = False  # until its first delta carried them


_COMPILED = object()  # put into the inbox when a grammar is compiled: wakes an idle loop
_COMPILE_THREADS = 2


class EngineCore:
    def __init__(self, engine, send: Callable[[Outbound], None]):
        self.engine = engine
        self._send = send
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._abort_at: float | None = None  # set by the first Drain
        self._draining = False
        # Adds whose grammar compiles on a worker thread, in arrival order
        self._compiling: dict[str, tuple[Add, Future]] = {}
        self._compiler = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar")

    def serve(self) -> None:
        """Runs until a Stop (or the HTTP process goes away, which the reader turns into one);
        then aborts what is left and runs the engine dry."""
        engine = self.engine
        while True:
            events: list[tuple[str, Event]] = []
            stop = self._apply(self._take(block=not engine.has_unfinished()), events)
            if stop:
                self._emit(events)
                break
            self._admit_compiled(events)
            if self._abort_at is not None and time.monotonic() >= self._abort_at:
                self._abort_at = None
                for rid in list(self._live):
                    self._abort(rid)
            if engine.has_unfinished():
                self._step(events)
            self._emit(events)
        pending = [cmd for cmd, _ in self._compiling.values()]
        pending += [cmd for cmd in self._take(block=False) if isinstance(cmd, Add)]
        refused = [(cmd.request_id, Rejected(cmd.index, "the server is shutting down", 503))
                   for cmd in pending]
        self._compiling.clear()
        self._compiler.shutdown(wait=False, cancel_futures=True)
        for rid in list(self._live):
            self._abort(rid)
        while engine.has_unfinished():
            events = []
            self._step(events)
            self._emit(events)
        self._emit(refused, always=True)

    def _take(self, block: bool) -> list:
        # Idle: sleep on the inbox until a command comes (no polling). Busy: take whatever is
        # there without waiting, and step.
        items = [self.inbox.get()] if block else []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def _apply(self, commands: list, events: list[tuple[str, Event]]) -> bool:
        stop = False
        for cmd in commands:
            if isinstance(cmd, Add):
                if stop:
                    events.append((cmd.request_id,
                                   Rejected(cmd.index, "the server is shutting down", 503)))
                elif cmd.params.structured_outputs is not None:
                    self._compile(cmd)
                else:
                    events.append((cmd.request_id, self._add(cmd)))
            elif isinstance(cmd, Abort):
                if cmd.request_id in self._live:
                    self._abort(cmd.request_id)
                elif cmd.request_id in self._compiling:  # never admitted: nothing to send
                    _, future = self._compiling.pop(cmd.request_id)
                    future.add_done_callback(
                        lambda _, rid=cmd.request_id: self.engine.discard_grammar(rid))
            elif isinstance(cmd, Drain):  # a second drain never moves the first's deadline
                if not self._draining:
                    self._draining = True
                    self._abort_at = time.monotonic() + cmd.grace
            elif isinstance(cmd, Stop):
                stop = True
        return stop

    def _compile(self, cmd: Add) -> None:
        future = self._compiler.submit(self.engine.compile_grammar, cmd.request_id, cmd.params)
        future.add_done_callback(lambda _: self.inbox.put(_COMPILED))
        self._compiling[cmd.request_id] = (cmd, future)

    def _admit_compiled(self, events: list[tuple[str, Event]]) -> None:
        """Adds the requests whose grammar is compiled; refuses those whose grammar is not."""
        for rid, (cmd, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            error = future.exception()
            if error is None:
                events.append((rid, self._add(cmd)))
                self.engine.discard_grammar(rid)  # add_request took it, unless it refused
            elif isinstance(error, ValueError):
                events.append((rid, Rejected(cmd.index, str(error), 400)))
            else:
                log.error("compiling the grammar of %s failed", rid, exc_info=error)
                events.append((rid, Rejected(cmd.index, f"the engine could not compile the "
                                                        f"request's grammar: {error}", 500)))

    def _add(self, cmd: Add) -> Event:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except ValueError as e:  # validation the handler could not do: refuse this one only
            return Rejected(cmd.index, str(e), 400)
        except Exception as e:  # noqa: BLE001 -- one bad request must not end the loop
            log.exception("add_request(%s) failed", cmd.request_id)
            return Rejected(cmd.index, f"the engine could not take the request: {e}", 500)
        self._live[cmd.request_id] = _Live(cmd.index, cmd.params.logprobs is not None,
                                           wants_prompt_logprobs=cmd.params.prompt_logprobs
                                           is not None)
        return Admitted(cmd.index)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except ValueError:
            pass  # it ended in the same step the client left: nothing to free

    def _step(self, events: list[tuple[str, Event]]) -> None:
        for out in self.engine.step():
            lv = self._live.get(out.request_id)
            if lv is None:
                continue
            new = out.new_token_ids
            lv.num_tokens += len(new)
            lps = out.logprobs[-len(new):] if lv.wants_logprobs and new else None
            prompt_lps = None
            if lv.wants_prompt_logprobs and out.prompt_logprobs is not None:
                prompt_lps, lv.wants_prompt_logprobs = out.prompt_logprobs, False
            if out.finished:
                del self._live[out.request_id]
            events.append((out.request_id, Delta(lv.index, new, out.new_text or "", lps,
                                                 out.finish_reason, lv.num_tokens,
                                                 prompt_lps)))

    def _emit(self, events: list[tuple[str, Event]], always: bool = False) -> None:
        # One message per iteration, whatever the batch size. An idle wake-up that produced
        # nothing sends nothing, unless the counters must reach /metrics (always).
        if events or always:
            self._send(("events", events, EngineSnapshot.of(self.engine)))


def _read_commands(conn: Connection, inbox: queue.SimpleQueue) -> None:
    """The reader thread: pipe -> inbox. The HTTP process gone (EOF) counts as a Stop."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(Stop())


def run_engine_process(factory: Callable[[], object], commands: Connection, events: Connection,
                       log_level: str = "INFO") -> None:
    """The engine process's main (a spawn target: factory must pickle)."""
    # Shutdown is the HTTP process's to decide: a SIGINT or SIGTERM sent to the whole process
    # group must not end the engine under requests that are still being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .model_info import ModelInfo

    send = functools.partial(write_frame, events.fileno())
    try:
        engine = factory()
        send(("ready", ModelInfo.of(engine), EngineSnapshot.of(engine)))
    except BaseException as e:  # noqa: BLE001 -- reported to the HTTP process
        log.exception("the engine failed to start")
        send(("failed", f"{type(e).__name__}: {e}"))
        return
    core = EngineCore(engine, send)
    threading.Thread(target=_read_commands, args=(commands, core.inbox),
                     name="graphexec-commands", daemon=True).start()
    try:
        core.serve()
        send(("stopped",))
    except BaseException as e:  # noqa: BLE001
        log.exception("the engine loop failed")
        try:
            send(("failed", f"{type(e).__name__}: {e}"))
        except OSError:
            pass  # the HTTP process is gone: nobody to tell
    finally:
        try:
            engine.close()
        except Exception:  # noqa: BLE001 -- closing is best effort on the way out
            log.exception("closing the engine failed")
