"""Request fields -> SamplingParams, with every refusal naming the field the client wrote.

Ranges are checked by SamplingParams itself; its ValueError starts with the name of its own
field, which is mapped back to the API's name for it (max_completion_tokens, top_logprobs...).
The context limits are checked here, before admission, so the engine never sees a
request it would refuse.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..sampling_params import MAX_SEED, SamplingParams
from ..structured import StructuredOutputsParams
from .errors import APIError, invalid
from .model_info import ModelInfo
from .prompts import check_unicode
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .tools import tool_mode

MAX_N = 16  # choices per request: each is a whole request in the engine


@dataclass(frozen=True)
class FieldNames:
    """The API's names for the SamplingParams fields whose name differs by endpoint."""

    max_tokens: str
    logprobs: str
    prompt: str
    structured: str = "structured_outputs"  # or response_format, whichever the client sent


COMPLETION_FIELDS = FieldNames(max_tokens="max_tokens", logprobs="logprobs", prompt="prompt")


def chat_fields(req: ChatCompletionRequest) -> FieldNames:
    return FieldNames(
        max_tokens="max_completion_tokens" if req.max_completion_tokens is not None
        else "max_tokens", logprobs="top_logprobs", prompt="messages",
        structured="response_format" if _response_format(req) else "structured_outputs")


def _unsupported(param: str, what: str) -> APIError:
    return invalid(f"{param}: {what} is not supported by this server", param,
                   code="unsupported_parameter")


def check_common(req: SamplingFields) -> None:
    """What does not depend on the prompt: checked once per HTTP request."""
    if req.n < 1 or req.n > MAX_N:
        raise invalid(f"n must be an integer in [1, {MAX_N}], got {req.n}", "n")
    check_unicode(req.stop, "stop", "stop")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise _unsupported("suffix", "a suffix")
        if req.best_of not in (None, req.n):
            raise _unsupported("best_of", "best_of other than n")
    if isinstance(req, ChatCompletionRequest):
        if _response_format(req) and req.structured_outputs:
            raise invalid("response_format and structured_outputs: send one of them",
                          "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")


def _max_tokens(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def _logprobs(req: SamplingFields) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _prompt_logprobs(req: SamplingFields) -> int | None:
    """echo with logprobs (completions) shows the prompt's logprobs too, with as many
    alternatives as the output's."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return max(req.logprobs, req.prompt_logprobs or 0)
    return req.prompt_logprobs


def sampling_params(req: SamplingFields, names: FieldNames, prompt_len: int, info: ModelInfo,
                    index: int = 0) -> SamplingParams:
    """The params of choice `index` of a prompt of `prompt_len` tokens."""
    limit = min(info.max_model_len, info.kv_capacity_tokens)
    room = limit - prompt_len
    if room < 1:
        raise invalid(f"{names.prompt} is {prompt_len} tokens long; this model's context is "
                      f"{limit} tokens, which leaves no room to generate",
                      names.prompt, code="context_length_exceeded")
    max_tokens = _max_tokens(req)
    if max_tokens is None:  # as many as the context allows
        max_tokens = room
    elif max_tokens > room:
        raise invalid(f"{names.max_tokens}={max_tokens} with a {prompt_len}-token prompt goes "
                      f"past this model's context of {limit} tokens (at most {room} here)",
                      names.max_tokens, code="context_length_exceeded")
    if req.stop and info.tokenizer is None:
        raise invalid("stop: stop strings are matched on the text, and this model has no "
                      "tokenizer; use stop_token_ids", "stop")
    seed = req.seed
    if seed is not None and index and 0 <= seed <= MAX_SEED:
        # n choices with one seed would be n copies of one sample
        seed = (seed + index) % (MAX_SEED + 1)
    options = dict(
        max_tokens=max_tokens, min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k, seed=seed,
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
        # stop="" goes through so that it is refused as [""] is: it would match everywhere
        logprobs=_logprobs(req), stop=[] if req.stop is None else req.stop,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0, logit_bias=req.logit_bias or None,
        prompt_logprobs=_prompt_logprobs(req))
    try:
        options["structured_outputs"] = structured_outputs(req)
        return SamplingParams(**options)
    except ValueError as e:
        raise _renamed(str(e), names) from None


def _renamed(message: str, names: FieldNames) -> APIError:
    """SamplingParams' messages start with its field's name: put the API's name there."""
    m = re.match(r"[a-z_]+", message)
    field = m.group(0) if m else None
    api = {"max_tokens": names.max_tokens, "logprobs": names.logprobs,
           "structured_outputs": names.structured}.get(field, field)
    if field and api != field:
        message = api + message[len(field):]
    return invalid(message, api)


def _response_format(req: SamplingFields) -> dict | None:
    """A chat request's response_format, unless it asks for plain text."""
    rf = getattr(req, "response_format", None)
    return rf if rf and rf.get("type", "text") != "text" else None


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"schema": ...}}) or the structured_outputs extension, as StructuredOutputsParams. Its
    ValueErrors start with structured_outputs (mapped back to the field the client sent).
    Tools with tool_choice "required" or a named function constrain the output to the call."""
    rf = _response_format(req)
    mode = tool_mode(req.tools, req.tool_choice) if isinstance(req, ChatCompletionRequest) \
        else None
    if mode is not None:
        if rf is not None or req.structured_outputs is not None:
            raise ValueError("structured_outputs: a tool call's output follows its schema; "
                             "send no response_format or structured_outputs with tool_choice")
        return mode.structured()
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (rf.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs: response_format must be {\"type\": "
                             "\"json_object\"} or {\"type\": \"json_schema\", "
                             "\"json_schema\": {\"schema\": {...}}}")
        return StructuredOutputsParams(json=schema)
    if req.structured_outputs is None:
        return None
    known = {"json", "regex", "choice", "grammar", "json_object"}
    extra = set(req.structured_outputs) - known
    if extra:
        raise ValueError(f"structured_outputs takes {sorted(known)}, not {sorted(extra)}")
    return StructuredOutputsParams(**req.structured_outputs)
