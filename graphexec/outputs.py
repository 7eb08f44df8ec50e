"""What the engine hands back to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """logprob of the chosen token, and the top-n alternatives as {token_id: logprob}."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


class RequestOutput:
    """One request's state after a step. `token_ids` and `logprobs` are cumulative. The engine
    passes the request's own append-only lists and their length at this step, and the properties
    slice them on access: building a step's output costs O(new tokens) however long the output
    grows (copying the whole history into every step's output made long streams quadratic).
    Built from plain lists (no length given), an output simply holds them."""

    __slots__ = ("request_id", "prompt_token_ids", "new_token_ids", "finish_reason",
                 "new_text", "num_drafted_tokens", "num_accepted_tokens", "_tokens", "_n_tokens",
                 "_logprobs", "_n_logprobs", "_text", "_text_pieces", "_n_text_pieces",
                 "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int],
                 new_token_ids: list[int] | None = None, finish_reason: str | None = None,
                 logprobs: list[TokenLogprob] | None = None, text: str | None = None,
                 num_drafted_tokens: int = 0, num_accepted_tokens: int = 0, *,
                 num_tokens: int | None = None, num_logprobs: int | None = None,
                 new_text: str | None = None, text_pieces: list[str] | None = None,
                 num_text_pieces: int = 0,
                 prompt_logprobs: list[TokenLogprob | None] | None = None):
        self.request_id = request_id
        # SamplingParams.prompt_logprobs: one per prompt token, None for the first
        self.prompt_logprobs = prompt_logprobs
        self.prompt_token_ids = prompt_token_ids
        self.new_token_ids = new_token_ids if new_token_ids is not None else []
        self.finish_reason = finish_reason  # "stop" | "length" | "abort"; None while running
        # Text (with a tokenizer): `new_text` is this step's delta; `text`, the cumulative text,
        # is given whole or as the request's append-only list of deltas, joined on access.
        self.new_text = new_text
        self._text = text
        self._text_pieces = text_pieces
        self._n_text_pieces = num_text_pieces
        # speculative decoding: draft tokens proposed for and accepted into this request
        self.num_drafted_tokens = num_drafted_tokens
        self.num_accepted_tokens = num_accepted_tokens
        self._tokens = token_ids
        self._n_tokens = len(token_ids) if num_tokens is None else num_tokens
        self._logprobs = logprobs
        self._n_logprobs = (len(logprobs) if logprobs is not None and num_logprobs is None
                            else num_logprobs)

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[:self._n_tokens]

    @property
    def text(self) -> str | None:
        if self._text is None and self._text_pieces is not None:
            self._text = "".join(self._text_pieces[:self._n_text_pieces])
        return self._text

    @text.setter
    def text(self, value: str | None) -> None:
        self._text, self._text_pieces = value, None

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """One per token, when the request asked for logprobs."""
        return None if self._logprobs is None else self._logprobs[:self._n_logprobs]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _key(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.new_token_ids,
                self.finish_reason, self.logprobs, self.text, self.new_text,
                self.num_drafted_tokens,
                self.num_accepted_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestOutput) and self._key() == other._key()

    __hash__ = None  # mutable, like the dataclass it replaced

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids!r}, "
                f"new_token_ids={self.new_token_ids!r}, finish_reason={self.finish_reason!r})")
