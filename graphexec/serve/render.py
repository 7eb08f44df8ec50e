"""Pieces of response bodies both endpoints share: choices accumulated from deltas, usage,
logprob token strings, and the stream's ending."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii

from ..outputs import TokenLogprob
from .errors import APIError, unavailable
from .events import Delta
from .generation import SSE_DONE, Generation, sse


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


@dataclass
class Choice:
    """One choice's output, accumulated from its deltas (a non-streamed answer)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, d: Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason


async def collect(gen: Generation) -> list[Choice]:
    choices = [Choice() for _ in gen.jobs]
    async for d in gen.deltas():
        choices[d.index].add(d)
    if any(c.finish_reason == "abort" for c in choices):
        # only the server aborts a request whose client is still waiting: when it stops
        raise aborted_error()
    return choices


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def prompt_tokens_of(gen: Generation, n: int) -> int:
    """Each prompt counts once, however many choices (n) it was sampled for."""
    return sum(len(job.prompt) for job in gen.jobs[::n])


class TokenText:
    """Token id -> the text logprobs show for it. Without a tokenizer, "token_id:<id>"."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self._tok is None:
                s = f"token_id:{token_id}"
            else:  # special tokens shown too: a logprob of "" would say nothing
                s = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s


def prompt_logprobs_json(lps: list[TokenLogprob | None] | None,
                         token_text: TokenText) -> list[dict | None] | None:
    """The prompt_logprobs extension, as vLLM gives it: per prompt token None (the first) or
    {token id: {"logprob", "decoded_token"}} for the token itself and the top n."""
    if lps is None:
        return None
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entries = {lp.token_id: lp.logprob, **lp.top}
        out.append({str(t): {"logprob": v, "decoded_token": token_text(t)}
                    for t, v in entries.items()})
    return out


class ChunkFrame:
    """A stream's chunks as SSE events, byte for byte what sse({**head, "choices": [choice]})
    gives: the head (id, object, created, model) is the same in every chunk, so it is encoded
    once per stream and each chunk encodes only its choice."""

    def __init__(self, head: dict):
        self._open = "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":['

    def event(self, choice_json: str) -> str:
        return self._open + choice_json + "]}\n\n"


def json_str(s: str) -> str:
    """s as json.dumps writes it (ASCII, escaped): the one field of a chunk that varies most."""
    return encode_basestring_ascii(s)


async def sse_body(gen: Generation, chunks: AsyncIterator[dict | str],
                   usage_chunk: Callable[[], dict] | None) -> AsyncIterator[str]:
    """The SSE body: each chunk (a dict, or an event ChunkFrame already wrote), the usage chunk
    if asked for, then [DONE]. An error after the stream began (the engine failed, or the
    server aborted the request as it stopped) can no longer change the status code: it goes
    out as an error event."""
    try:
        async for chunk in chunks:
            yield chunk if chunk.__class__ is str else sse(chunk)
        if usage_chunk is not None:
            yield sse(usage_chunk())
    except APIError as e:
        yield sse(e.body())
    finally:
        gen.abort()  # the client left mid-stream (cancelled here) or the stream ended
    yield SSE_DONE


def aborted_error() -> APIError:
    return unavailable("the request was aborted: the server is shutting down", "shutting_down")
