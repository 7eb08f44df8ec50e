"""What the engine hands back to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """logprob of the chosen token, and the top-n alternatives as {token_id: logprob}."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # cumulative
    new_token_ids: list[int] = field(default_factory=list)  # what this step added
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    logprobs: list[TokenLogprob] | None = None  # cumulative, one per token, when asked
    text: str | None = None
    # speculative decoding: draft tokens proposed for and accepted into this request
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
