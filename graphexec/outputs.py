"""What the engine hands back to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """logprob of the chosen token, and the top-n alternatives as {token_id: logprob}."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step. `token_ids` and `logprobs` are cumulative: they are
    read, on access, from the request's own append-only lists up to the length they had at this
    step, so a step costs O(new tokens) per request however long the output grows (copying the
    whole history into every step's output made long streams quadratic)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)  # what this step added
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    text: str | None = None
    # speculative decoding: draft tokens proposed for and accepted into this request
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # the request's lists and their length at this step (appended to, never rewritten)
    _all_tokens: list[int] = field(default_factory=list, repr=False)
    _all_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    _length: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self._length < 0:
            self._length = len(self._all_tokens)

    @property
    def token_ids(self) -> list[int]:
        return self._all_tokens[:self._length]

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One per token, when the request asked for logprobs."""
        if self._all_logprobs is None:
            return None
        return self._all_logprobs[:self._length]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, "
                f"new_token_ids={self.new_token_ids!r}, finish_reason={self.finish_reason!r})")
