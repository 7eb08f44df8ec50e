"""POST /v1/chat/completions: the conversation rendered with the model's chat template."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import offload
from .body import json_body
from .generation import ClientGone, Generation, GenerationStream, Job, until_disconnect
from .params import chat_fields, check_common, sampling_params
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest
from .render import (ChunkFrame, Choice, TokenText, aborted_error, collect, created, new_id,
                     prompt_logprobs_json, prompt_tokens_of, sse_body, usage)
from .state import ServerState
from .tool_parsers import CallArguments, CallStart, Content, Event, ToolCallParser
from .tools import AutoTools, ToolMode, auto_tools, new_call, tool_mode

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
        request: Request,
        body: ChatCompletionRequest = json_body(ChatCompletionRequest)) -> Response:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_common(body)
    info = state.model_info()
    tools = tool_mode(body.tools, body.tool_choice)
    auto = auto_tools(body.tools, body.tool_choice, state.config.tool_call_parser,
                      getattr(info.tokenizer, "chat_template", None))
    names = chat_fields(body)
    state.check_fits_queue(1, body.n)
    # Template rendering and tokenising scale with the conversation: off the event loop.
    prompt = await offload.run(chat_prompt, body, info)
    jobs = [Job(prompt, sampling_params(body, names, len(prompt), info, i))
            for i in range(body.n)]
    gen = Generation(state, new_id("chatcmpl"), jobs, names)
    try:
        await gen.start()
    except BaseException:
        gen.abort()
        raise
    fmt = _Logprobs(TokenText(info.tokenizer)) if body.logprobs else None
    if body.stream:
        head = {"id": gen.request_id, "object": "chat.completion.chunk", "created": created(),
                "model": state.config.served_model_name}
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        totals = [0] * len(jobs)
        usage_chunk = (lambda: {**head, "choices": [], "usage": usage(
            prompt_tokens_of(gen, body.n), sum(totals))}) if include_usage else None
        chunks = (_parsed_chunks(gen, head, fmt, body.return_token_ids, totals, auto)
                  if auto is not None else
                  _chunks(gen, head, fmt, body.return_token_ids, totals, tools))
        return GenerationStream(gen, sse_body(gen, chunks, usage_chunk))
    try:
        choices = await until_disconnect(request, collect(gen))
    except ClientGone:
        return Response(status_code=499)
    finally:
        gen.abort()
    extra = {}
    if body.prompt_logprobs is not None:  # the extension, as vLLM places it: one prompt
        extra["prompt_logprobs"] = prompt_logprobs_json(choices[0].prompt_logprobs,
                                                        TokenText(info.tokenizer))
    return JSONResponse({
        "id": gen.request_id, "object": "chat.completion", "created": created(),
        "model": state.config.served_model_name,
        "choices": [_choice(i, c, fmt, body.return_token_ids, tools, auto)
                    for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens_of(gen, body.n), sum(len(c.token_ids) for c in choices)),
        **extra})


def _choice(index: int, c: Choice, fmt: "_Logprobs | None", return_ids: bool,
            tools: ToolMode | None, auto: AutoTools | None = None) -> dict:
    text = "".join(c.text)
    message = {"role": "assistant", "content": text}
    finish = c.finish_reason
    calls = tools.calls(text) if tools is not None and finish == "stop" else None
    if calls is not None:
        message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
    elif auto is not None:
        message, finish = auto.message(text, finish)
    out = {"index": index, "message": message,
           "logprobs": fmt.of(c.logprobs) if fmt else None, "finish_reason": finish}
    if return_ids:
        out["token_ids"] = c.token_ids
    return out


async def _chunks(gen: Generation, head: dict, fmt: "_Logprobs | None", return_ids: bool,
                  totals: list[int], tools: ToolMode | None = None
                  ) -> AsyncIterator[dict | str]:
    # The role comes first, once per choice, as OpenAI streams it.
    calls = _StreamedCalls(tools, len(gen.jobs)) if tools is not None else None
    frame = ChunkFrame(head)  # the head encoded once for the stream's chunks
    for i in range(len(gen.jobs)):
        delta = {"role": "assistant", "content": ""} if calls is None else calls.first(i)
        yield {**head, "choices": [{"index": i, "delta": delta,
                                    "logprobs": None, "finish_reason": None}]}
    async for d in gen.deltas():
        if d.finish_reason == "abort":
            raise aborted_error()
        totals[d.index] = d.num_tokens
        if not (d.text or d.finish_reason or (d.token_ids and (fmt or return_ids))):
            continue
        delta = {"content": d.text} if d.text else {}
        finish = d.finish_reason
        if calls is not None:
            delta, finish = calls.delta(d.index, d.text, finish)
        choice = {"index": d.index, "delta": delta,
                  "logprobs": fmt.of(d.logprobs or []) if fmt else None,
                  "finish_reason": finish}
        if return_ids:
            choice["token_ids"] = d.token_ids
        yield frame.event(json.dumps(choice, separators=(",", ":")))


async def _parsed_chunks(gen: Generation, head: dict, fmt: "_Logprobs | None", return_ids: bool,
                         totals: list[int], auto: AutoTools) -> AsyncIterator[dict]:
    """tool_choice "auto": each choice's text goes through its parser, and what it decides
    goes out as content and tool_calls deltas; what may still become a call waits."""
    readers = [_CallDeltas(auto.reader()) for _ in gen.jobs]
    for i in range(len(gen.jobs)):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for d in gen.deltas():
        if d.finish_reason == "abort":
            raise aborted_error()
        totals[d.index] = d.num_tokens
        reader = readers[d.index]
        deltas = reader.feed(d.text, d.finish_reason is not None)
        finish = d.finish_reason
        if finish == "stop" and reader.calls:
            finish = "tool_calls"
        extra = bool(d.token_ids) and (fmt is not None or return_ids)
        if not deltas and (finish or extra):
            deltas = [{}]
        for n, delta in enumerate(deltas):
            last = n == len(deltas) - 1
            choice = {"index": d.index, "delta": delta,
                      "logprobs": fmt.of(d.logprobs or []) if fmt and last else None,
                      "finish_reason": finish if last else None}
            if return_ids:
                choice["token_ids"] = d.token_ids if last else []
            yield {**head, "choices": [choice]}


class _CallDeltas:
    """One choice's parser events as stream deltas, OpenAI's way: a call's first delta has its
    index, id, type, name and arguments ""; later ones append to its arguments."""

    def __init__(self, reader: ToolCallParser):
        self.reader = reader
        self.calls = 0

    def feed(self, text: str, last: bool) -> list[dict]:
        events = self.reader.feed(text) if text else []
        if last:
            events += self.reader.finish()
        return self._deltas(events)

    def _deltas(self, events: list[Event]) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            prev = out[-1] if out else None
            if isinstance(ev, Content):
                if prev is not None and "content" in prev:
                    prev["content"] += ev.text
                else:
                    out.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                self.calls += 1
                call = {**new_call(ev.name, ""), "index": ev.index}
                out.append({"tool_calls": [call]})
            elif isinstance(ev, CallArguments):
                part = prev["tool_calls"][0] if prev and "tool_calls" in prev else None
                if part is not None and part["index"] == ev.index and "id" not in part:
                    part["function"]["arguments"] += ev.text
                else:
                    out.append({"tool_calls": [{"index": ev.index,
                                                "function": {"arguments": ev.text}}]})
        return out


class _StreamedCalls:
    """tool_calls as stream deltas: a named function's id and name first, then its arguments
    as they come; with "required", the whole call once complete (its name is inside it)."""

    def __init__(self, tools: ToolMode, num_choices: int):
        self.tools = tools
        self.text = [""] * num_choices

    def first(self, index: int) -> dict:
        if self.tools.named is None:
            return {"role": "assistant", "content": None}
        call = {**new_call(self.tools.named, ""), "index": 0}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    def delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        self.text[index] += text
        finish = "tool_calls" if finish == "stop" else finish
        if self.tools.named is not None:
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text
                    else {}), finish
        calls = self.tools.calls(self.text[index]) if finish == "tool_calls" else None
        if calls is None:  # held back until complete; cut short, it goes out as text
            return ({"content": self.text[index]} if finish else {}), finish
        return {"tool_calls": [{**c, "index": j} for j, c in enumerate(calls)]}, finish


class _Logprobs:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def __init__(self, token_text: TokenText):
        self.token_text = token_text

    def _entry(self, token_id: int, logprob: float) -> dict:
        s = self.token_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def of(self, lps) -> dict:
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [
                self._entry(t, v) for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]}
            for lp in lps]}
