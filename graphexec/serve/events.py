"""What crosses between the HTTP process and the engine process, in both directions.

Commands go down a pipe to the engine process (engine_core.py); events come back up another,
and the HTTP side hands each to the HTTP request it belongs to (its Sink). A request with n
choices is n engine requests feeding one Sink; each event says which choice it is for. Everything but Sink is pickled on its way.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..outputs import TokenLogprob
from ..sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine took the request: from here on its outputs follow."""

    index: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """Before Admitted: the engine refused it (status 400) or the server is stopping (503).
    After Admitted: the engine loop failed (500); no more events follow."""

    index: int
    message: str
    status: int = 400


class Delta(NamedTuple):
    """What one step added to one choice. finish_reason: "stop", "length" or "abort".

    A NamedTuple rather than a dataclass: one crosses the pipe per request per step, and a
    tuple unpickles in a quarter of the time of a slots dataclass (whose __setstate__ walks
    its fields for every object)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_tokens: int  # output tokens so far, these included
    # SamplingParams.prompt_logprobs: on the choice's first delta only
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def then(self, later: "Delta") -> "Delta":
        """This delta and the next one of the same choice, as one."""
        lps = None if self.logprobs is None and later.logprobs is None else (
            (self.logprobs or []) + (later.logprobs or []))
        return Delta(self.index, self.token_ids + later.token_ids, self.text + later.text, lps,
                     later.finish_reason, later.num_tokens,
                     self.prompt_logprobs or later.prompt_logprobs)


Event = Admitted | Rejected | Delta


@dataclass(eq=False, slots=True)
class Sink:
    """One HTTP request's events, on the event loop: filled only there (by the event reader
    thread's call_soon_threadsafe callbacks, or a refusal made on the loop), emptied by its
    Generation. A list and one waiter rather than an asyncio.Queue: the reader takes all that
    arrived at once, so a put per token costs an append and, at most, one wake-up."""

    arrival: float = field(default_factory=time.monotonic)
    # per choice, when its last tokens arrived: time to first token and inter-token latency
    last_token_at: dict[int, float] = field(default_factory=dict)
    _events: list[Event] = field(default_factory=list)
    _waiter: asyncio.Future | None = None

    def put(self, ev: Event) -> None:
        self._events.append(ev)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take_nowait(self) -> list[Event]:
        """Whatever arrived since the last take, oldest first; maybe nothing."""
        events, self._events = self._events, []
        return events

    async def take(self) -> list[Event]:
        """Whatever arrived since the last take, waiting for at least one event."""
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take_nowait()


@dataclass(slots=True)
class Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    index: int


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Drain:
    """Shutdown has begun: whatever still runs `grace` seconds from now is aborted, so its
    stream ends with an error event rather than being cut when the server stops waiting."""

    grace: float


class Stop:
    """Finish: abort what is left, close the engine, end the engine process."""
