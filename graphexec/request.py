"""One request's host-side state. The scheduler and the reconciler read and write it; no tensors."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .outputs import RequestOutput, TokenLogprob
from .sampling_params import SamplingParams
from .structured import RowGrammar
from .text.request_text import RequestText


class Status(enum.Enum):
    WAITING = "waiting"  # not in the batch: new, or evicted and waiting to recompute
    PREFILLING = "prefilling"  # admitted, its prompt's KV being written chunk by chunk
    RUNNING = "running"  # owns a row of the decode state
    PAUSED = "paused"  # out of the batch under KV pressure, KV kept; resumes first
    FINISHED = "finished"


@dataclass(slots=True)  # slots: attribute access on the per-row hot path
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int  # admission order key; a larger value arrived later
    seed: int  # effective seed: the user's, or one drawn from the engine's generator
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    max_len: int  # prompt + output may not exceed this (context limit)
    top_k: int = 0  # effective top-k: 0 when off, or when it keeps the whole vocabulary
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    blocks: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # What the host knows of steps it launched but has not read yet. Positions advance by one
    # per plain step (at most K+1 per speculative one) whatever the tokens turn out to be, so
    # the host can reserve KV blocks ahead without knowing the tokens.
    in_flight: int = 0  # launched steps (prefill included) not reconciled yet
    advance_bound: int = 0  # the most positions those steps can have advanced the row
    advance_floor: int = 0  # the fewest tokens they emit: 1 per decode step, speculative or not
    num_drafted: int = 0  # speculative tokens proposed for this request
    num_accepted: int = 0
    last_launched_step: int = -1
    new_tokens: list[int] = field(default_factory=list)  # added since the last output
    # Set at admission: the tokens whose KV the prefill writes (prompt + output[:-1]), and how
    # many of them the chunks launched so far cover.
    prefill_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_keys: list[bytes] = field(default_factory=list)  # prefix caching: full blocks' keys
    text: RequestText | None = None  # with a tokenizer: the output text, stop strings
    # prompt_logprobs: one per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: RowGrammar | None = None  # structured outputs: its matcher, one token behind none
    # output tokens at which it ends by length: max_tokens, or the context limit if sooner
    output_limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.output_limit = min(self.params.max_tokens, self.max_len - len(self.prompt))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def ends_in_flight(self) -> bool:
        """Steps already launched are certain to reach max_tokens or the context limit, so a
        further step would only make tokens the host drops. (A stop token may end it sooner.)"""
        return self._reaches_length(self.advance_floor)

    @property
    def may_end_in_flight(self) -> bool:
        """Steps already launched can reach the length limit if they emit all they may."""
        return self._reaches_length(self.advance_bound)

    def _reaches_length(self, more: int) -> bool:
        return len(self.output) + more >= self.output_limit

    def launched(self, step_id: int, fewest: int, most: int) -> None:
        """A step that emits between `fewest` and `most` tokens for this request (and advances
        its position by at most `most`) was launched."""
        self.in_flight += 1
        self.advance_floor += fewest
        self.advance_bound += most
        self.last_launched_step = step_id  # its blocks are written until this step retires

    def reconciled(self, fewest: int, most: int, tokens: list[int],
                   logprobs: list[TokenLogprob | None] | None) -> int:
        """The results of a step launched with `launched(_, fewest, most)`: appends its tokens
        until one ends the request. Returns how many it appended; none once the request had
        finished (a row that ended earlier still ran in the steps launched before the host knew)."""
        self.in_flight -= 1
        self.advance_floor -= fewest
        self.advance_bound -= most
        if most > 1:  # a speculative step: K drafted, count - 1 accepted
            self.num_drafted += most - 1
            self.num_accepted += len(tokens) - 1
        if self.finished:
            return 0
        for i, token in enumerate(tokens):
            self.append(token, logprobs[i] if logprobs is not None else None)
            if self.finished:  # tokens after a stop in an accepted run are dropped
                return i + 1
        return len(tokens)

    def append(self, token: int, logprob: TokenLogprob | None) -> None:
        """Adds one sampled token and decides whether the request is done."""
        self.output.append(token)
        self.new_tokens.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        n = len(self.output)
        if token in self.stop_ids and n >= self.params.min_tokens:
            self.finish("stop")
        elif (self.text is not None and self.text.has_stops  # text checked token by token
              and self.text.feed(self.output, check_stops=n > self.params.min_tokens)):
            self.finish("stop")
        elif n >= self.output_limit:
            self.finish("length")

    def set_prompt_logprobs(self, start: int, chosen: list[float], top_vals: list[list[float]],
                            top_ids: list[list[int]]) -> None:
        """The logprobs of prompt tokens start + 1, start + 2, ... (a chunk's share). A prompt
        prefilled again after an eviction writes the same entries again."""
        n = self.params.prompt_logprobs
        for j, lp in enumerate(chosen):
            pos = start + 1 + j
            self.prompt_logprobs[pos] = TokenLogprob(self.prompt[pos], lp,
                                                     dict(zip(top_ids[j][:n], top_vals[j][:n])))

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def take_output(self) -> RequestOutput:
        text = self.text
        new_text = text.advance(self.output, self.finished) if text is not None else None
        out = RequestOutput(
            self.request_id, self.prompt, self.output, self.new_tokens, self.finish_reason,
            self.logprobs, num_drafted_tokens=self.num_drafted,
            num_accepted_tokens=self.num_accepted, num_tokens=len(self.output),
            num_logprobs=len(self.logprobs) if self.logprobs is not None else None,
            new_text=new_text, text_pieces=text.pieces if text is not None else None,
            num_text_pieces=len(text.pieces) if text is not None else 0,
            prompt_logprobs=self.prompt_logprobs)
        self.new_tokens = []
        return out
