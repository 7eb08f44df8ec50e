"""Chat templates: a conversation rendered to prompt text with the model's Jinja template.

Templates shipped with HF models expect what transformers' renderer provides: blocks trimmed
(trim_blocks, lstrip_blocks), the loopcontrols extension, `raise_exception` and `strftime_now`
helpers, a `tojson` that keeps non-ASCII text as it is, and `bos_token` / `eos_token`. The
template comes from the model, so it runs sandboxed.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache

Message = dict  # {"role": str, "content": str, ...}


class ChatTemplateError(ValueError):
    """Raised by a template's own raise_exception (a conversation the template refuses)."""


def validate_conversation(messages, where: str = "messages") -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"{where}[{i}] must be a dict with 'role' and 'content', "
                             f"got {msg!r}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                raise ValueError(f"{where}[{i}].{key} must be a string, got "
                                 f"{msg.get(key)!r} (message {msg!r})")
    return list(messages)


def render_chat(tokenizer, messages: list[Message], add_generation_prompt: bool = True,
                chat_template: str | None = None, **extra) -> str:
    """The prompt text for `messages`. chat_template overrides the tokenizer's; extra keyword
    arguments reach the template as variables (e.g. tools, documents)."""
    messages = validate_conversation(messages)
    source = chat_template if chat_template is not None else getattr(
        tokenizer, "chat_template", None)
    if not source:
        raise ValueError("chat_template: the model has none; pass chat_template=... or build "
                         "the prompt yourself and call generate")
    if not isinstance(source, str):
        raise ValueError(f"chat_template must be a Jinja template string, got {source!r}")
    return _compile(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=getattr(tokenizer, "bos_token", None) or "",
        eos_token=getattr(tokenizer, "eos_token", None) or "", **extra)


def encode_chat(tokenizer, messages: list[Message], add_generation_prompt: bool = True,
                chat_template: str | None = None, **extra) -> list[int]:
    """Token ids of the rendered conversation. The template writes the special tokens (BOS
    included) itself, so the tokenizer adds none."""
    text = render_chat(tokenizer, messages, add_generation_prompt, chat_template, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat_template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML: prompts must see the characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (messages, tools, documents...): a
    template that never reads `tools` cannot show the model its tools."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(_environment().parse(source)))


@lru_cache(maxsize=8)
def _compile(source: str):
    return _environment().from_string(source)


@lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
