"""POST /v1/completions: a prompt (text or token ids, or a batch of either), n choices each."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .body import json_body
from .generation import ClientGone, Generation, GenerationStream, Job, until_disconnect
from .params import COMPLETION_FIELDS, check_common, sampling_params
from .prompts import completion_prompts
from .protocol import CompletionRequest
from .render import (Choice, TokenText, aborted_error, collect, created, new_id,
                     prompt_tokens_of, sse_body, usage)
from .state import ServerState

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(
        request: Request, body: CompletionRequest = json_body(CompletionRequest)) -> Response:
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    check_common(body)
    info = state.model_info()
    # Tokenising takes seconds for a prompt of megabytes: a worker thread keeps the event
    # loop (other streams, /health) going meanwhile.
    prompts = await asyncio.to_thread(completion_prompts, body.prompt, info)
    state.check_fits_queue(len(prompts), body.n)
    jobs = [Job(p, sampling_params(body, COMPLETION_FIELDS, len(p), info, i))
            for p in prompts for i in range(body.n)]
    gen = Generation(state, new_id("cmpl"), jobs, COMPLETION_FIELDS)
    try:
        await gen.start()
    except BaseException:
        gen.abort()
        raise
    head = {"id": gen.request_id, "object": "text_completion", "created": created(),
            "model": state.config.served_model_name}
    fmt = _Logprobs(TokenText(info.tokenizer), len(jobs)) if body.logprobs is not None else None
    if body.stream:
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
    return JSONResponse({**head, "choices": [
        _choice(i, c, fmt, body.return_token_ids) for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens_of(gen, body.n),
                       sum(len(c.token_ids) for c in choices))})


def _choice(index: int, c: Choice, fmt: "_Logprobs | None", return_ids: bool) -> dict:
    out = {"index": index, "text": "".join(c.text),
           "logprobs": fmt.of(index, c.logprobs) if fmt else None,
           "finish_reason": c.finish_reason}
    if return_ids:
        out["token_ids"] = c.token_ids
    return out


async def _chunks(gen: Generation, head: dict, fmt: "_Logprobs | None", return_ids: bool,
                  totals: list[int]) -> AsyncIterator[dict]:
    async for d in gen.deltas():
        if d.finish_reason == "abort":
            raise aborted_error()
        totals[d.index] = d.num_tokens
        # Tokens whose text is held back (a partial UTF-8 character, a possible stop string)
        # still go out when the client asked to see tokens.
        if not (d.text or d.finish_reason or (d.token_ids and (fmt or return_ids))):
            continue
        choice = {"index": d.index, "text": d.text,
                  "logprobs": fmt.of(d.index, d.logprobs or []) if fmt else None,
                  "finish_reason": d.finish_reason}
        if return_ids:
            choice["token_ids"] = d.token_ids
        yield {**head, "choices": [choice]}


class _Logprobs:
    """The completions logprobs object; text_offset runs on across one choice's chunks."""

    def __init__(self, token_text: TokenText, num_choices: int):
        self.token_text = token_text
        self.offsets = [0] * num_choices

    def of(self, index: int, lps) -> dict:
        tokens, offsets = [], []
        for lp in lps:
            s = self.token_text(lp.token_id)
            tokens.append(s)
            offsets.append(self.offsets[index])
            self.offsets[index] += len(s)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.token_text(t): v for t, v in sorted(
                    lp.top.items(), key=lambda kv: -kv[1])} for lp in lps],
                "text_offset": offsets}
