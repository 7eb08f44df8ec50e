"""One HTTP request's engine requests (n choices per prompt), from admission to the last token.

Whatever ends the HTTP request early (the client hangs up, the handler is cancelled, a sibling
choice is refused), every choice still running is aborted in the engine: `abort()` is called
from a finally on every path, and the streaming response calls it even when its body was never
started.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..sampling_params import SamplingParams
from .errors import APIError, invalid
from .events import Delta, Rejected, Sink
from .params import FieldNames
from .state import ServerState


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    params: SamplingParams


class Generation:
    def __init__(self, state: ServerState, request_id: str, jobs: list[Job], names: FieldNames):
        self.state = state
        self.request_id = request_id
        self.jobs = jobs
        self.names = names
        self.sink = Sink()
        self._engine_ids = [f"{request_id}-{i}" for i in range(len(jobs))]
        self._submitted = False
        self._unfinished = set(range(len(jobs)))
        self._early: list[Delta] = []  # outputs of a choice that came before a sibling's answer

    async def start(self) -> None:
        """Submits every choice and waits until the engine took them all. Raises APIError (and
        aborts the ones it took) if it refused any."""
        self.state.admit(len(self.jobs))  # raises when full or not serving
        loop = self.state.loop
        for i, job in enumerate(self.jobs):
            loop.submit(self._engine_ids[i], job.prompt, job.params, self.sink, i)
        self._submitted = True
        refused: Rejected | None = None
        answered = 0
        while answered < len(self.jobs):
            events = await self.sink.take()
            for k, ev in enumerate(events):
                if answered == len(self.jobs):  # outputs of the last choice's first step
                    self._early.extend(events[k:])
                    break
                if isinstance(ev, Delta):
                    self._early.append(ev)
                    continue
                answered += 1
                if isinstance(ev, Rejected):
                    self._unfinished.discard(ev.index)
                    refused = refused or ev
        if refused is not None:
            self.abort()
            self.state.metrics.refused.labels("engine").inc()
            message = self._public(refused.message)
            if refused.status == 400:
                raise invalid(message, _param_of_engine_error(refused.message, self.names))
            raise APIError(message, status=refused.status, type="server_error")
        self.state.metrics.prompt_tokens.inc(sum(len(j.prompt) for j in self.jobs))

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's outputs, in arrival order, until all have finished. Consecutive
        deltas of one choice that are already queued come out as one: a stream that fell
        behind (a slow client, a busy event loop) catches up in one chunk instead of paying
        a chunk per step, and the work it costs falls as the load rises."""
        pending = deque(self._early)
        self._early.clear()
        sink = self.sink
        while pending or self._unfinished:
            pending.extend(await sink.take() if not pending else sink.take_nowait())
            ev = pending.popleft()
            if isinstance(ev, Rejected):  # the engine failed under us
                self._unfinished.clear()
                raise APIError(self._public(ev.message), status=ev.status,
                               type="server_error")
            if not isinstance(ev, Delta):
                continue
            while (ev.finish_reason is None and pending and isinstance(pending[0], Delta)
                   and pending[0].index == ev.index):
                ev = ev.then(pending.popleft())
            if ev.finish_reason is not None:
                self._unfinished.discard(ev.index)
            yield ev

    def _public(self, message: str) -> str:
        """The engine's message without this server's internal request ids (the engine names
        the request it refused; the client knows which one it sent)."""
        for eid in self._engine_ids:
            q = repr(eid)
            message = message.replace(f"request {q}: ", "").replace(f" for {q}", "")
            message = message.replace(q, "the request").replace(eid, "the request")
        return message

    def abort(self) -> None:
        """Aborts every choice not finished yet; idempotent, never blocks."""
        if not self._submitted:
            return
        for i in sorted(self._unfinished):
            self.state.loop.abort(self._engine_ids[i])
        self._unfinished.clear()


def _param_of_engine_error(message: str, names: FieldNames) -> str | None:
    """Engine.add_request's messages start with the field at fault, in its own terms
    ("prompt_token_ids for ...", "stop_token_ids ...", "request ...: prompt + max_tokens=...")."""
    m = re.match(r"[a-z_]+", message)
    head = m.group(0) if m else ""
    if head == "request" and "max_tokens" in message:
        return names.max_tokens
    if head.startswith("prompt"):
        return names.prompt
    return {"max_tokens": names.max_tokens, "logprobs": names.logprobs,
            "structured_outputs": names.structured}.get(head, head or None)


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def until_disconnect(request: Request, work: Awaitable):
    """Runs `work`, cancelling it if the client hangs up first (a non-streamed request has no
    write that would fail, so its disconnect must be listened for)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its generation however the response ends, including when
    the client left before the body started (Starlette then never runs the body iterator, so a
    finally inside it would not run either)."""

    def __init__(self, gen: Generation, body: AsyncIterator[str]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.abort()
