"""Per-request sampling options, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """max_tokens: tokens to generate at most. min_tokens: EOS and stop ids are suppressed until
    this many were generated. temperature 0 means greedy. top_k <= 0 (or -1) disables top-k;
    top_p 1.0 disables top-p. seed makes the request's draws a pure function of (seed, token
    index). logprobs: None for none, n in 0..20 for the chosen token's logprob plus the top n.
    stop: strings that end the request when the generated text contains one (needs a
    tokenizer); the text is cut before it unless include_stop_str_in_output.
    skip_special_tokens: leave special tokens out of the output text.
    presence_penalty / frequency_penalty (-2..2): OpenAI's, over the generated tokens: a
    token's logit loses frequency_penalty * its count + presence_penalty if it occurred.
    repetition_penalty (> 0, 1 is off): over prompt and generated tokens, as transformers and
    vLLM: a positive logit is divided by it, a negative one multiplied. min_p (0..1): after
    temperature, keep the tokens whose probability is at least min_p times the largest.
    logit_bias: {token id: bias in -100..100}, at most 300, added before the penalties.
    prompt_logprobs: None, or n in 0..20 for each prompt token's logprob and the top n.
    structured_outputs: a StructuredOutputsParams the output must follow (needs a tokenizer)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] | str = field(default_factory=list)  # a single string is one stop
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both disable it) or a positive integer, "
                             f"got {self.top_k!r}")
        if (not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool)
                or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if (not isinstance(self.stop, (list, tuple))
                or not all(isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        self.stop = list(self.stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self._check_penalties()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(so).__name__}")
        if so is not None and self.ignore_eos:
            raise ValueError("ignore_eos: a structured output ends where its grammar does")
        # read for every row of every step (the scheduler's variant): computed once
        self._uses_penalties = bool(self.penalty_fields)

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
            setattr(self, name, float(v))
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        self.repetition_penalty = float(r)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        self.min_p = float(self.min_p)
        self.logit_bias = _checked_bias(self.logit_bias)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in "
                             f"[0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether the row needs the device's per-row token state (capture/penalties.py):
        a penalty, a logit bias or min_p. Rows without any run the plain sampler."""
        return self._uses_penalties

    @property
    def penalty_fields(self) -> list[str]:
        """The fields among the penalties, logit_bias and min_p that are not off."""
        on = dict(presence_penalty=self.presence_penalty != 0,
                  frequency_penalty=self.frequency_penalty != 0,
                  repetition_penalty=self.repetition_penalty != 1.0, min_p=self.min_p > 0,
                  logit_bias=bool(self.logit_bias))
        return [name for name, used in on.items() if used]

    def token_ids_outside(self, vocab: int) -> tuple[str, int] | None:
        """The first (field, token id) that names a token outside [0, vocab), or None."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                return name, bad
        return None


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)
            and math.isfinite(x))


def _checked_bias(bias) -> dict[int, float] | None:
    """logit_bias as {int: float}; keys may be decimal strings (JSON object keys)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, "
                         f"got {len(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tok = int(k) if isinstance(k, str) and k.isdecimal() else k
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if not _is_number(v) or not -100 <= v <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} "
                             f"for token {k!r}")
        if tok in out:
            raise ValueError(f"logit_bias names token {tok} twice")
        out[tok] = float(v)
    return out
