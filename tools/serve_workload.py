"""Seeded request streams for the serving benchmark (tools/bench_serve.py).

Three kinds:
- offline: every request due at t = 0, lognormal prompt and output lengths (or one fixed prompt
  length), random token ids.
- online: the same lengths, due as a Poisson process at a given rate. The gaps are one draw of
  unit-rate exponentials scaled by 1 / rate, so every rate replays the same arrival pattern,
  only compressed or stretched in time.
- shared-prefix: conversations whose turns all start with one long system prompt. Turn k resends
  turn k-1's prompt and its output and adds a new user message, so it is due when turn k-1
  finishes; the driver fills the previous output in (see RequestSpec.after). First turns are
  due at t = 0.

Lengths and arrivals depend on the seed only; token ids also depend on the run index, so two
runs on one engine never share a prompt (a prefix cache would otherwise carry hits from one run
into the next), while the same run index on another engine (the other mode) gets the same ids.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Streams of the seed: one per quantity, so adding a quantity never shifts another's draws.
_LENGTHS, _ARRIVALS, _TOKENS, _USER = 0, 1, 2, 3
LOWEST_TOKEN = 3  # skip the ids special tokens usually take (bos/eos/pad)


@dataclass(frozen=True)
class LengthDist:
    """Lognormal lengths with the given median, rounded and clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.high):
            raise ValueError(f"length clip [{self.low}, {self.high}] must satisfy 1 <= low <= high")
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"median={self.median} must be > 0 and sigma={self.sigma} >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 400
    seed: int = 0
    prompt: LengthDist = LengthDist(median=300, sigma=0.9, low=16, high=2048)
    output: LengthDist = LengthDist(median=120, sigma=0.7, low=8, high=512)
    fixed_prompt_len: int | None = None  # every prompt this long (the churn variant)
    system_prompt_len: int = 2000
    turns: int = 4  # turns per conversation (shared-prefix)
    user: LengthDist = LengthDist(median=100, sigma=0.8, low=8, high=512)

    def __post_init__(self) -> None:
        for name in ("num_requests", "system_prompt_len", "turns"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.fixed_prompt_len is not None and self.fixed_prompt_len < 1:
            raise ValueError(f"fixed_prompt_len must be >= 1, got {self.fixed_prompt_len!r}")


@dataclass
class RequestSpec:
    request_id: str
    arrival_s: float  # due this long after the run starts (follow-up turns: when `after` ends)
    prompt_ids: list[int]  # whole prompt; for a follow-up turn only its new user message
    output_len: int  # exact: the driver asks for ignore_eos
    prompt_len: int  # whole prompt length, follow-up turns included
    after: str | None = None  # previous turn: its prompt and output go before prompt_ids


@dataclass
class Workload:
    kind: str  # "offline" | "online" | "shared-prefix"
    rate: float | None  # requests/s for online, else None
    requests: list[RequestSpec] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.kind if self.rate is None else f"{self.kind}@{self.rate:g}"


def _rng(cfg: WorkloadConfig, stream: int, run_index: int = 0) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, stream, run_index])


def _token_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(LOWEST_TOKEN, vocab, size=n).tolist()


def request_lengths(cfg: WorkloadConfig, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) lengths of the offline/online requests. A prompt is shortened where
    prompt + output would pass the engine's context limit, so every output length is exact."""
    rng = _rng(cfg, _LENGTHS)
    prompt = cfg.prompt.sample(rng, cfg.num_requests)
    output = cfg.output.sample(rng, cfg.num_requests)
    if cfg.fixed_prompt_len is not None:
        prompt = np.full(cfg.num_requests, cfg.fixed_prompt_len, dtype=np.int64)
    output = np.minimum(output, max_len - 1)
    prompt = np.maximum(np.minimum(prompt, max_len - output), 1)
    return prompt, output


def poisson_arrivals(cfg: WorkloadConfig, rate: float) -> np.ndarray:
    """Arrival times (s) at `rate` requests/s, the first at 0 so no run opens idle."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    gaps = _rng(cfg, _ARRIVALS).exponential(1.0, size=cfg.num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps) / rate


def offline_workload(cfg: WorkloadConfig, vocab: int, max_len: int,
                     run_index: int = 0) -> Workload:
    return _independent("offline", None, np.zeros(cfg.num_requests), cfg, vocab, max_len,
                        run_index)


def online_workload(cfg: WorkloadConfig, vocab: int, max_len: int, rate: float,
                    run_index: int = 0) -> Workload:
    return _independent("online", rate, poisson_arrivals(cfg, rate), cfg, vocab, max_len,
                        run_index)


def _independent(kind: str, rate: float | None, arrivals: np.ndarray, cfg: WorkloadConfig,
                 vocab: int, max_len: int, run_index: int) -> Workload:
    prompt, output = request_lengths(cfg, max_len)
    rng = _rng(cfg, _TOKENS, run_index)
    reqs = [RequestSpec(f"{kind}-{i}", float(t), _token_ids(rng, int(p), vocab), int(o), int(p))
            for i, (t, p, o) in enumerate(zip(arrivals, prompt, output))]
    return Workload(kind, rate, reqs)


def shared_prefix_workload(cfg: WorkloadConfig, vocab: int, max_len: int,
                           run_index: int = 0) -> Workload:
    """ceil(num_requests / turns) conversations of up to `turns` turns, num_requests turns in
    all. A conversation stops early where its next turn would pass the context limit."""
    if cfg.system_prompt_len + cfg.user.low + cfg.output.low > max_len:
        raise ValueError(f"system_prompt_len={cfg.system_prompt_len} leaves no room for a turn "
                         f"within the engine's max_model_len={max_len}")
    lengths = _rng(cfg, _USER)
    tokens = _rng(cfg, _TOKENS, run_index)
    system = _token_ids(tokens, cfg.system_prompt_len, vocab)
    reqs: list[RequestSpec] = []
    conversations = -(-cfg.num_requests // cfg.turns)
    for c in range(conversations):
        prev: RequestSpec | None = None
        turns = min(cfg.turns, cfg.num_requests - c * cfg.turns)
        for t in range(turns):
            user = int(cfg.user.sample(lengths, 1)[0])
            out = int(cfg.output.sample(lengths, 1)[0])
            before = cfg.system_prompt_len if prev is None else prev.prompt_len + prev.output_len
            prompt_len = before + user
            if prompt_len + out > max_len:
                out = max_len - prompt_len
                if out < cfg.output.low:
                    break
            ids = _token_ids(tokens, user, vocab)
            spec = RequestSpec(f"conv{c}-turn{t}", 0.0, system + ids if prev is None else ids,
                               out, prompt_len, after=None if prev is None else prev.request_id)
            reqs.append(spec)
            prev = spec
    return Workload("shared-prefix", None, reqs)


def build_workloads(cfg: WorkloadConfig, kinds: list[str], rates: list[float], vocab: int,
                    max_len: int) -> list[Workload]:
    """The runs of one engine, in order; each gets its own run index (fresh token ids)."""
    out: list[Workload] = []
    for kind in kinds:
        if kind == "offline":
            out.append(offline_workload(cfg, vocab, max_len, len(out)))
        elif kind == "online":
            out += [online_workload(cfg, vocab, max_len, r, len(out) + i)
                    for i, r in enumerate(rates)]
        elif kind == "shared-prefix":
            out.append(shared_prefix_workload(cfg, vocab, max_len, len(out)))
        else:
            raise ValueError(f"kind={kind!r} is not one of offline, online, shared-prefix")
    return out
