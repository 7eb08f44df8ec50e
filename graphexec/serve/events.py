"""What crosses between the event loop and the engine thread, in both directions.

Commands go in through a thread-safe inbox; events come back onto the asyncio.Queue of the HTTP
request they belong to (its Sink). A request with n choices is n engine requests feeding one
Sink; each event says which choice it is for.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

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


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to one choice. finish_reason: "stop", "length" or "abort"."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_tokens: int  # output tokens so far, these included


Event = Admitted | Rejected | Delta


@dataclass(eq=False)
class Sink:
    """One HTTP request's events, on the event loop. Created on the event loop (the queue binds
    to it); filled only there, by the engine thread's call_soon_threadsafe callbacks."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    # per choice, when its last tokens arrived: time to first token and inter-token latency
    last_token_at: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    sink: Sink
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
    """Finish: abort what is left, close the engine, end the thread."""
