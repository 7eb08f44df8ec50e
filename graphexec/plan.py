"""What the scheduler hands the runner each step: the plan types and the bucket sizes they are
padded to. Plain data, no tensors: the scheduler builds them, the runner (and capture/) reads
them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .request import Request

# How many sequences one prefill step packs at most (the captured graphs' fixed count).
MAX_PREFILL_SEQS = 16
# The smallest token bucket. Up to 64 rows the projections run the decode-tuned Triton kernels,
# so smaller buckets only cost time (docs/architecture.md).
MIN_TOKEN_BUCKET = 64
# Batch buckets: a decode step over n rows runs the graph of the smallest bucket >= n.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def default_buckets(max_batch: int) -> list[int]:
    out = [b for b in DEFAULT_BUCKETS if b < max_batch]
    b = 96
    while b < max_batch:
        out.append(b)
        b += 32
    return out + [max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """The captured prefill sizes: every 64 tokens to 512 and every 256 beyond, and max_tokens
    itself. A prefill is compute-bound, so padding costs its share of the time: steps this fine
    keep it under about 15% of a large prefill, and the scheduler cuts chunks to a bucket's
    size (bucket_floor) so a long prompt's chunks pad nothing."""
    out, b = [], MIN_TOKEN_BUCKET
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 64 else b + (64 if b < 512 else 256)
    return out + [max_tokens]


def bucket_floor(buckets: list[int], tokens: int) -> int:
    """The largest bucket not above `tokens` (the smallest bucket if none is)."""
    return max((b for b in buckets if b <= tokens), default=buckets[0])


class Variant(NamedTuple):
    """What a launched step computes besides tokens; each variant is its own graph. The host
    picks it from the rows' parameters, so no row pays for work no row in the batch needs."""

    logprobs: bool = False  # the chosen token's logprob and the top 20
    filters: bool = True  # top-k / top-p (False: no row uses them)
    # Some row samples (temperature > 0). False: every row is greedy, and the speculative
    # iteration compares argmaxes instead of building and sampling distributions over the
    # vocabulary (the same tokens and counts, a few dozen fewer kernels per iteration).
    # Plain decoding keeps it True: its sampler has no such cost.
    sampled: bool = True
    # Some row uses penalties, logit bias or min_p (capture/penalties.py); False: the step
    # launches none of their kernels.
    penalties: bool = False
    # Some row follows a grammar (graphexec/structured.py): the step applies the token masks
    # the host wrote for it. A speculative engine captures it only together with penalties
    # (whose kernels skip rows without a slot), so its scheduler sets both.
    grammar: bool = False


@dataclass
class RowPenalties:
    """What a joining row's penalty slot is filled with: its SamplingParams' penalties, and
    the tokens they count (the request's own lists, read when the step is launched)."""

    presence: float
    frequency: float
    repetition: float
    min_p: float
    logit_bias: dict[int, float]
    prompt: list[int]
    output: list[int]  # generated so far: a resumed or recomputed request has some


@dataclass
class NewRow:
    """A request entering the batch. A prefilled row gets its token, position and step from
    the prefill; a resumed row (paused, KV intact) gets them from here."""

    row: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_tokens: int
    stop_ids: list[int]
    input_id: int = 0
    position: int = 0
    step: int = 0
    penalties: RowPenalties | None = None  # None: the row uses none


@dataclass
class StepDelta:
    """What changes in the batch before a step launches. Empty when nothing changed."""

    num_rows: int
    row_map: list[int] | None = None  # new row i takes old row row_map[i]; None: no compaction
    new_rows: list[NewRow] = field(default_factory=list)
    block_entries: list[tuple[int, int, int]] = field(default_factory=list)  # (row, col, block)


@dataclass
class PrefillChunk:
    """One sequence's share of a prefill step: its tokens at positions start.. , written into
    `blocks`. The last chunk of a prompt samples (or, for a request recomputing after eviction,
    resumes from its last token) into decode row `row`; an earlier chunk has row None."""

    token_ids: list[int]
    start: int  # position of token_ids[0]: the KV of positions < start is already written
    blocks: list[int]
    row: int | None = None  # the DecodeState row it joins as, on its last chunk
    step: int = 0  # index of the next output token of this request
    resume_token: int | None = None  # evicted request: its last token, next input; no sample
    # prompt_logprobs: the prompt tokens that follow positions start, start + 1, ... in this
    # chunk, whose logprobs the step computes (eagerly); None: none asked
    logprob_targets: list[int] | None = None

    @property
    def samples(self) -> int:
        """Tokens this chunk emits: 1 for a prompt's last chunk, 0 otherwise."""
        return int(self.row is not None and self.resume_token is None)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class Plan:
    """One step, as the scheduler decided it."""

    step_id: int
    delta: StepDelta | None  # None: the batch is unchanged since the last step
    prefills: list[PrefillChunk]
    prefill_requests: list[Request]  # one per chunk
    rows: list[Request]  # row order at launch: results are matched to requests by it
    bucket: int
    variant: Variant

    @property
    def empty(self) -> bool:
        return not self.rows and not self.prefills
