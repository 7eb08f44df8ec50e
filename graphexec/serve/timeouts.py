"""Read timeouts for slow clients, in the HTTP protocol itself.

Uvicorn closes a keep-alive connection that stays idle after a response, but it has no limit on
how long a request's headers or body may take to arrive: a client that sends half its headers,
or drips a byte every half second, holds its connection (a file descriptor, buffers, an ASGI
task waiting on the body) for as long as it likes, and keeps the process from exiting on
SIGTERM. Headers are read before any ASGI code runs, so the limits live in a subclass of
uvicorn's httptools protocol:

- headers: from the connection's opening, or the end of the previous response on a kept-alive
  connection, until the request's headers are complete;
- body: from the end of the headers until the last byte of the body.

Past either, the client gets a 408 in the OpenAI error shape (when no response has begun) and
the connection is closed; bytes that are not HTTP get a 400 in that shape too. On shutdown a request whose body is still arriving gets a 503 at
once rather than holding the exit until its body deadline.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import APIError

log = logging.getLogger("graphexec.serve")


@dataclass(frozen=True)
class ReadTimeouts:
    headers: float = 10.0  # seconds for a request's headers (a slow-loris client's budget)
    body: float = 60.0  # seconds for a body: 8 MiB (the default size limit) at 1 Mbit/s

    def __post_init__(self) -> None:
        for name in ("headers", "body"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"the {name} read timeout must be a positive number of "
                                 f"seconds, got {value!r}")


def protocol_class(timeouts: ReadTimeouts) -> type:
    """The uvicorn protocol class (uvicorn.Config(http=...)) that enforces `timeouts`."""
    return type("TimedHttpToolsProtocol", (TimedProtocol,), {"timeouts": timeouts})


def raw_response(err: APIError) -> bytes:
    """A whole HTTP response that closes the connection, written to the transport directly:
    no ASGI cycle is running for the request, or the one that is has not answered."""
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 {err.status} {_REASONS[err.status]}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("latin-1") + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}


class TimedProtocol(HttpToolsProtocol):
    timeouts: ReadTimeouts = ReadTimeouts()
    _timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._timed_out, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.timeouts.headers, "headers")

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        # A request without a body completes in the same parse, which disarms this at once.
        self._arm(self.timeouts.body, "body")

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's headers are counted from here (uvicorn's keep-alive timer closes
        # the connection sooner if nothing at all arrives). A pipelined request that started
        # just now already has its headers.
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self._arm(self.timeouts.headers, "headers")

    def _timed_out(self, what: str, seconds: float) -> None:
        self._timer = None
        log.debug("closing a connection from %s: its request %s took over %g s",
                  self.client, what, seconds)
        self._refuse(APIError(f"the request's {what} did not arrive within {seconds:g} s",
                              status=408, code="request_timeout"))

    def _refuse(self, err: APIError) -> None:
        """Answer err if nothing has been answered for this request, tell its ASGI task (if
        any) that the client is gone, and close the connection."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(raw_response(err))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the task's own answer, if any, goes nowhere
            cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # Bytes that do not parse as HTTP: uvicorn's plain-text 400, in the error shape.
        self._disarm()
        self.transport.write(raw_response(APIError(f"not a valid HTTP request ({msg})",
                                                   code="invalid_http")))
        self.transport.close()

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            self._disarm()
            self._refuse(APIError("the server is shutting down", status=503,
                                  type="service_unavailable", code="shutting_down"))
            return
        super().shutdown()
