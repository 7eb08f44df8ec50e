"""POST /v1/chat/completions: the conversation rendered with the model's chat template."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .body import json_body
from .generation import ClientGone, Generation, GenerationStream, Job, until_disconnect
from .params import chat_fields, check_common, sampling_params
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest
from .render import (Choice, TokenText, aborted_error, collect, created, new_id,
                     prompt_logprobs_json, prompt_tokens_of, sse_body, usage)
from .state import ServerState

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
        request: Request,
        body: ChatCompletionRequest = json_body(ChatCompletionRequest)) -> Response:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_common(body)
    info = state.model_info()
    names = chat_fields(body)
    state.check_fits_queue(1, body.n)
    # Template rendering and tokenising scale with the conversation: off the event loop.
    prompt = await asyncio.to_thread(chat_prompt, body, info)
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
        chunks = _chunks(gen, head, fmt, body.return_token_ids, totals)
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
        "choices": [_choice(i, c, fmt, body.return_token_ids) for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens_of(gen, body.n), sum(len(c.token_ids) for c in choices)),
        **extra})


def _choice(index: int, c: Choice, fmt: "_Logprobs | None", return_ids: bool) -> dict:
    out = {"index": index, "message": {"role": "assistant", "content": "".join(c.text)},
           "logprobs": fmt.of(c.logprobs) if fmt else None, "finish_reason": c.finish_reason}
    if return_ids:
        out["token_ids"] = c.token_ids
    return out


async def _chunks(gen: Generation, head: dict, fmt: "_Logprobs | None", return_ids: bool,
                  totals: list[int]) -> AsyncIterator[dict]:
    # The role comes first, once per choice, as OpenAI streams it.
    for i in range(len(gen.jobs)):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for d in gen.deltas():
        if d.finish_reason == "abort":
            raise aborted_error()
        totals[d.index] = d.num_tokens
        if not (d.text or d.finish_reason or (d.token_ids and (fmt or return_ids))):
            continue
        choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                  "logprobs": fmt.of(d.logprobs or []) if fmt else None,
                  "finish_reason": d.finish_reason}
        if return_ids:
            choice["token_ids"] = d.token_ids
        yield {**head, "choices": [choice]}


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
