"""POST /v1/completions: a prompt (text or token ids, or a batch of either), n choices each."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from . import offload
from .body import json_body
from .generation import ClientGone, Generation, GenerationStream, Job, until_disconnect
from .params import COMPLETION_FIELDS, check_common, sampling_params
from .prompts import completion_prompts
from .protocol import CompletionRequest
from .render import (Choice, ChunkFrame, TokenText, aborted_error, collect, created, json_str,
                     new_id, prompt_logprobs_json, prompt_tokens_of, sse_body, usage)
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
    prompts = await offload.run(completion_prompts, body.prompt, info)
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
    token_text = TokenText(info.tokenizer)
    fmt = _Logprobs(token_text, len(jobs)) if body.logprobs is not None else None
    out = _Render(fmt, token_text, body, [j.prompt for j in jobs], info.tokenizer)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        totals = [0] * len(jobs)
        usage_chunk = (lambda: {**head, "choices": [], "usage": usage(
            prompt_tokens_of(gen, body.n), sum(totals))}) if include_usage else None
        chunks = _chunks(gen, ChunkFrame(head), out, totals)
        return GenerationStream(gen, sse_body(gen, chunks, usage_chunk))
    try:
        choices = await until_disconnect(request, collect(gen))
    except ClientGone:
        return Response(status_code=499)
    finally:
        gen.abort()
    return JSONResponse({
        **head, "choices": [out.choice(i, c) for i, c in enumerate(choices)],
        "usage": usage(prompt_tokens_of(gen, body.n), sum(len(c.token_ids) for c in choices))})


class _Render:
    """A choice's body: the text and logprobs, after the prompt's with `echo` (on the choice's
    first chunk when streamed), token ids and prompt logprobs when asked."""

    def __init__(self, fmt: "_Logprobs | None", token_text: TokenText, body: CompletionRequest,
                 prompts: list[list[int]], tokenizer):
        self.fmt, self.token_text, self.body, self.prompts = fmt, token_text, body, prompts
        self.echo = [_prompt_text(body.prompt, i // body.n, p, tokenizer)
                     for i, p in enumerate(prompts)] if body.echo else None
        self.started: set[int] = set()

    def choice(self, index: int, c: Choice) -> dict:
        return self.part(index, "".join(c.text), c.token_ids, c.logprobs, c.finish_reason,
                         c.prompt_logprobs)

    def part(self, index: int, text: str, token_ids: list[int], lps, finish_reason,
             prompt_lps) -> dict:
        first = index not in self.started
        self.started.add(index)
        logprobs = None
        if self.fmt is not None:
            echoed = self.echo is not None and first  # the prompt's offsets come first
            prompt = self.fmt.of_prompt(index, self.prompts[index], prompt_lps) if echoed else None
            logprobs = self.fmt.of(index, lps or [])
            if prompt is not None:
                logprobs = {k: prompt[k] + logprobs[k] for k in logprobs}
        out = {"index": index, "text": (self.echo[index] if self.echo and first else "") + text,
               "logprobs": logprobs, "finish_reason": finish_reason}
        if self.body.return_token_ids:
            out["token_ids"] = token_ids
        if self.body.prompt_logprobs is not None and first:
            out["prompt_logprobs"] = prompt_logprobs_json(prompt_lps, self.token_text)
        return out

    def part_json(self, index: int, text: str, token_ids: list[int], lps, finish_reason,
                  prompt_lps) -> str:
        """part() as JSON text. A chunk with nothing but text and token ids (every chunk of a
        stream without logprobs, echo or prompt logprobs after the first) is written directly,
        the same text json.dumps gives, at a fraction of its cost per token."""
        if self.fmt is not None or index not in self.started:
            return json.dumps(self.part(index, text, token_ids, lps, finish_reason, prompt_lps),
                              separators=(",", ":"))
        out = (f'{{"index":{index},"text":{json_str(text)},"logprobs":null,"finish_reason":'
               f'{"null" if finish_reason is None else json_str(finish_reason)}')
        if self.body.return_token_ids:
            out += f',"token_ids":[{",".join(map(str, token_ids))}]'
        return out + "}"


def _prompt_text(prompt: str | list, which: int, ids: list[int], tokenizer) -> str:
    """The prompt as echoed: as the client wrote it, or its token ids decoded ("" without a
    tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt[which], str):
        return prompt[which]
    return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""


async def _chunks(gen: Generation, frame: ChunkFrame, out: _Render,
                  totals: list[int]) -> AsyncIterator[str]:
    async for d in gen.deltas():
        if d.finish_reason == "abort":
            raise aborted_error()
        totals[d.index] = d.num_tokens
        # Tokens whose text is held back (a partial UTF-8 character, a possible stop string)
        # still go out when the client asked to see tokens.
        shows_tokens = out.fmt or out.body.return_token_ids
        if not (d.text or d.finish_reason or (d.token_ids and shows_tokens)
                or d.index not in out.started):
            continue
        yield frame.event(out.part_json(d.index, d.text, d.token_ids, d.logprobs,
                                        d.finish_reason, d.prompt_logprobs))


class _Logprobs:
    """The completions logprobs object; text_offset runs on across one choice's chunks."""

    def __init__(self, token_text: TokenText, num_choices: int):
        self.token_text = token_text
        self.offsets = [0] * num_choices

    def of(self, index: int, lps) -> dict:
        return self._object(index, [lp.token_id for lp in lps], lps)

    def of_prompt(self, index: int, ids: list[int], lps) -> dict:
        """The echoed prompt's part: its first token has no logprob (nothing precedes it)."""
        return self._object(index, ids, lps or [None] * len(ids))

    def _object(self, index: int, ids: list[int], lps) -> dict:
        tokens, offsets = [], []
        for t in ids:
            s = self.token_text(t)
            tokens.append(s)
            offsets.append(self.offsets[index])
            self.offsets[index] += len(s)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else {self.token_text(t): v for t, v in sorted(
                    lp.top.items(), key=lambda kv: -kv[1])} for lp in lps],
                "text_offset": offsets}
