"""Request bodies of the OpenAI API, as pydantic models.

They check shapes and types only; value ranges are SamplingParams' job (params.py maps its
errors back to the field the client wrote), so the two can never disagree. Fields the OpenAI API
has but this server does not implement are declared anyway, so that a non-default value is
refused by name instead of being silently ignored (params.py: reject_unsupported).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class _Body(BaseModel):
    # Unknown fields are ignored (as OpenAI does); the fields below are all the server reads.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by both endpoints. top_k, min_tokens, ignore_eos, stop_token_ids,
    return_token_ids, repetition_penalty, min_p and prompt_logprobs are extensions (the openai
    client sends them through `extra_body`)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id (a JSON object's key is a string) -> bias; the ids are checked as SamplingParams
    # takes them, so "x" is refused by name rather than by pydantic
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None
    # vLLM's StructuredOutputsParams as an object: one of json, regex, choice, grammar,
    # json_object
    structured_outputs: dict | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # Strict: lax ints would take true as 1 and 2.0 as 2, ids the client never meant.
    stop_token_ids: list[StrictInt] | None = None
    # Each choice also carries its generated token ids (always exact, whatever the text).
    return_token_ids: bool = False


class CompletionRequest(SamplingFields):
    # A string, a list of token ids, or a batch of either (one set of n choices per prompt).
    # Only the outer shape is checked here: prompts.py checks each item, so that true or 1.5
    # is refused as a token id by name instead of being coerced or blamed on a union member.
    prompt: str | list
    max_tokens: int | None = 16  # the OpenAI default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ...: kept for the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none", "auto", "required" or a named function
    response_format: dict | None = None
    add_generation_prompt: bool = True  # extension: render the assistant turn's header
