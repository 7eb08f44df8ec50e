"""Prompts -> token ids, in a worker thread of the HTTP process, before anything reaches the
engine (the handlers call these through offload.run, off the event loop).

Token ids are checked against the vocabulary here so that a bad id is refused by name instead
of being found by the engine; the context limit is checked with the params (params.py)."""
from __future__ import annotations

import json

from ..text.chat import encode_chat
from .errors import invalid
from .model_info import ModelInfo
from .protocol import ChatCompletionRequest, ChatMessage


def completion_prompts(prompt: str | list, info: ModelInfo) -> list[list[int]]:
    """A string, a list of token ids, or a batch of either -> one id list per prompt."""
    if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], (str, list))):
        batch, single = [prompt], True
    else:
        batch, single = prompt, False
    if not batch:
        raise invalid("prompt must not be empty", "prompt")
    out = []
    for i, p in enumerate(batch):
        where = "prompt" if single else f"prompt[{i}]"
        if isinstance(p, str):
            check_unicode(p, where, "prompt")
            ids = _encode(p, info, where)
        elif isinstance(p, list):
            ids = _token_ids(p, where)
        else:
            raise invalid(f"{where}: expected a string or a list of integer token ids, got "
                          f"{_shown(p)}", "prompt")
        if not ids:
            raise invalid(f"{where} is empty", "prompt")
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise invalid(f"{where} holds token id {bad}, outside the vocabulary "
                          f"[0, {info.vocab_size})", "prompt")
        out.append(ids)
    return out


def _token_ids(ids: list, where: str) -> list[int]:
    for j, t in enumerate(ids):
        if type(t) is not int:  # a bool is an int to Python, and 1.5 or "7" is no token id
            raise invalid(f"{where}[{j}]: expected an integer token id, got {_shown(t)}",
                          "prompt")
    return ids


def _shown(value: object) -> str:
    text = json.dumps(value)  # as the client wrote it: true, not True
    return text if len(text) <= 40 else text[:37] + "..."


def check_unicode(value: object, where: str, param: str | None = None) -> None:
    """Refuses text that is not valid Unicode (a lone surrogate such as "\\ud800" is valid
    JSON): the tokenizer would fail on it with a TypeError, which is the client's fault."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise invalid(f"{where} is not valid Unicode: {e.reason} at character {e.start}",
                          param or where) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, where, param)
            check_unicode(v, f"{where}.{k}", param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, f"{where}[{i}]", param)


def _encode(text: str, info: ModelInfo, where: str) -> list[int]:
    if info.tokenizer is None:
        raise invalid(f"{where}: this model has no tokenizer, so the prompt must be a list of "
                      "token ids", "prompt")
    check_text_fits(len(text), info, where)
    return info.tokenizer.encode(text)


def check_text_fits(chars: int, info: ModelInfo, where: str) -> None:
    """A text so long that even the tokenizer's longest entries (twice over, for what a
    normalizer may merge) would overrun the context is refused before it is tokenised: a
    10 MB prompt then costs microseconds instead of seconds of CPU."""
    limit = min(info.max_model_len, info.kv_capacity_tokens)
    if info.max_token_chars and chars > 2 * info.max_token_chars * limit:
        raise invalid(f"{where} is {chars} characters long, at least "
                      f"{chars // (2 * info.max_token_chars)} tokens; this model's context is "
                      f"{limit} tokens", "prompt", code="context_length_exceeded")


def chat_prompt(req: ChatCompletionRequest, info: ModelInfo) -> list[int]:
    if info.tokenizer is None:
        raise invalid("messages: this model has no tokenizer (and so no chat template); use "
                      "/v1/completions with token ids", "messages")
    messages = [_message(m) for m in req.messages]
    for i, m in enumerate(messages):
        check_unicode(m, f"messages[{i}]")
    check_text_fits(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)),
                    info, "messages")
    try:
        # templates that know tools render them (Llama 3.1+, Qwen2.5+, Hermes-style); with
        # tool_choice "none" too, as vLLM does: the model knows them but is not asked to call
        tools = req.tools or None
        return encode_chat(info.tokenizer, messages, req.add_generation_prompt,
                           **({"tools": tools} if tools else {}))
    except ValueError as e:  # no template, or the template refused the conversation
        raise invalid(f"messages: {e}", "messages") from None


def _message(m: ChatMessage) -> dict:
    msg = dict(m.model_extra or {})
    content = m.content
    if isinstance(content, list):  # text parts; other part types fail validation
        content = "".join(part.text for part in content)
    msg.update(role=m.role, content=content or "")
    return msg
