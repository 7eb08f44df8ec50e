"""Engine: the host loop. Each step: plan, launch, reconcile.

Async mode keeps one step in flight: step n is launched before the results of step n-1 are read,
so the GPU always has the next iteration queued while the host appends tokens, checks stop
conditions and emits outputs. Sync mode runs the same code and reads each step's results right
after launching it; it is the oracle async mode must equal token for token.
"""
from __future__ import annotations

import gc
import numbers
import os
import random
import threading
from collections import deque
from dataclasses import dataclass

import torch

from .block_pool import BlockPool
from .capture.results import ResultRows
from .config import EngineConfig
from .model import resolve_model
from .model.loader import read_model_config
from .outputs import RequestOutput, TokenLogprob
from .parallel import build_ranks
from .plan import Plan
from .request import Request, Status
from .rank import memory_figures, resolve_max_model_len
from .runner import Launched
from .sampling_params import MAX_SEED, SamplingParams
from .scheduler import Scheduler
from .structured import Grammars, fill_grammar_rows, grammar_rows
from .text.request_text import RequestText
from .text.tokenizer import load_tokenizer


@dataclass
class _InFlight:
    plan: Plan
    launched: Launched
    rows: list[tuple[Request, int, int]]  # (request, fewest, most tokens the step emits for it)


@dataclass
class EngineStats:
    """Counted from reconciled results only: reading them never syncs the device."""

    steps: int = 0
    tokens: int = 0
    # Launches that had to wait on the host for the device (a staging slot still in flight).
    # Async mode keeps this at 0.
    chain_breaks: int = 0
    # Steps where the scheduler had nothing it could launch, so the step in flight was read
    # before the next launch (all done, or only rows waiting on that step's tokens).
    idle_drains: int = 0
    # Async speculative steps that read the step in flight before planning, because it might
    # end every row (see Engine._all_rows_may_end_in_flight).
    settles: int = 0
    batch_size_sum: int = 0
    # Steps read before the next launch because a grammar row needs its token for the next
    # mask: every grammar step without a MaskGate (speculative or tensor-parallel engines, the
    # CPU), and with one the steps that do not replay a graph (capture/mask_gate.py).
    grammar_waits: int = 0


class Engine:
    def __init__(self, model: str, **options):
        self.config = cfg = EngineConfig(model=model, **options)
        if cfg.manifest is not None:
            _apply_manifest(cfg)
        source = resolve_model(cfg.model)
        self.model_config = mc = read_model_config(source)
        self.max_model_len = max_len = resolve_max_model_len(cfg, mc)
        self.tokenizer = load_tokenizer(source)
        # Rank 0's model, cache and runner; at tensor_parallel_size > 1 the workers that hold
        # the other shards run every launch of self.runner too (graphexec/parallel/).
        rank, self.workers = build_ranks(cfg, source, mc, max_len)
        self.kv, self.model, self.runner = rank.kv, rank.model, rank.runner
        # weight_bytes and kv_bytes_per_token for stats_summary(), which the server reads
        # every iteration: counted once here.
        self._memory_figures = memory_figures(self.model, self.kv)
        self.pool = BlockPool(rank.num_blocks, enable_caching=cfg.enable_prefix_caching)
        k = self.runner.k
        self.scheduler = Scheduler(self.pool, cfg, spec_tokens=k)
        self.requests: dict[str, Request] = {}
        self.in_flight: deque[_InFlight] = deque()
        self.stats = EngineStats()
        self._rng = random.Random(cfg.seed)
        self._arrivals = 0
        self._step_id = 0
        self._aborted: list[Request] = []
        # Waits while the graphs were captured are not chain breaks: only those while serving.
        self._waits_seen = self.runner.host_waits()
        self._closed = False
        self._grammars: Grammars | None = None  # built with the first structured request
        self._grammars_lock = threading.Lock()
        self._compiled: dict[str, object] = {}  # request id -> its grammar (compile_grammar)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Frees the engine's device memory now (graphs, KV cache, weights, staging buffers)
        rather than whenever Python collects it: a process that builds engines one after
        another should close each. Unfinished requests are dropped. Idempotent."""
        if self._closed:
            return
        # Steps in flight still use the buffers; after a tensor-parallel failure they may wait
        # on a dead rank forever, and nothing will read them.
        tp_failed = self.workers is not None and self.workers.failure is not None
        if self.config.device.type == "cuda" and not tp_failed:
            if self.runner.mask_gate is not None:  # a step may wait for masks: let it finish
                self.runner.mask_gate.open()
            torch.cuda.synchronize(self.config.device)
        self._closed = True
        self.requests.clear()
        self.in_flight.clear()
        self._aborted = []
        self.runner = self.model = self.kv = self.scheduler = self.pool = None
        # The graphs go before the process group: they hold NCCL work captured on it.
        gc.collect()
        if self.workers is not None:
            self.workers.close()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int] | str,
                    params: SamplingParams | None = None) -> None:
        self._check_open()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r} for {request_id!r}: stop strings need a "
                             "tokenizer and the model has none (use stop_token_ids)")
        prompt = self._validate_prompt(request_id, prompt_token_ids)
        self._check_fits(request_id, len(prompt), params.max_tokens)
        vocab = self.model_config.vocab_size
        outside = params.token_ids_outside(vocab)
        if outside is not None:  # it would index past the logits row on the device
            raise ValueError(f"{outside[0]} for {request_id!r} holds token id {outside[1]}, "
                             f"outside the vocabulary [0, {vocab})")
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        stop_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        if params.min_tokens and len(stop_ids) > 16:
            raise ValueError(f"stop_token_ids: with min_tokens > 0 at most 16 stop ids (EOS "
                             f"included) can be suppressed, got {len(stop_ids)}")
        grammar = self._grammar(request_id, params) if params.structured_outputs else None
        seed = params.seed if params.seed is not None else self._rng.randint(0, MAX_SEED)
        self._arrivals += 1
        req = Request(request_id=request_id, prompt=prompt, params=params,
                      arrival=self._arrivals, seed=seed, stop_ids=stop_ids,
                      max_len=self.max_model_len,
                      # top_k >= vocab filters nothing; passing it on would only send the row
                      # down the sampler's slow exact path
                      top_k=params.top_k if 0 < params.top_k < vocab else 0,
                      logprobs=[] if params.logprobs is not None else None,
                      prompt_logprobs=([None] * len(prompt)
                                       if params.prompt_logprobs is not None else None),
                      text=(RequestText.create(self.tokenizer, params)
                            if self.tokenizer is not None else None))
        req.grammar = grammar
        self.requests[request_id] = req
        self.scheduler.add(req)

    def compile_grammar(self, request_id: str, params: SamplingParams) -> None:
        """Compiles params.structured_outputs ahead of add_request(request_id, ...), which then
        takes it as it is; a ValueError if it does not compile. Safe on another thread while the
        engine steps: the server compiles there (serve/engine_core.py), so that a grammar that
        takes seconds to compile stalls no other request."""
        self._compiled[request_id] = self._grammars_for(request_id).compile(
            params.structured_outputs)

    def discard_grammar(self, request_id: str) -> None:
        """Forgets a grammar compile_grammar made for a request that was not added."""
        self._compiled.pop(request_id, None)

    def _grammars_for(self, request_id: str) -> Grammars:
        with self._grammars_lock:  # compile_grammar may run on several threads
            if self._grammars is None and self.tokenizer is not None:
                self._grammars = Grammars.for_tokenizer(
                    self.tokenizer, self.model_config.vocab_size,
                    list(self.model_config.eos_token_ids))
        if self._grammars is None:
            raise ValueError(f"structured_outputs for {request_id!r} needs a model with a "
                             "tokenizer")
        return self._grammars

    def _grammar(self, request_id: str, params: SamplingParams):
        return self._grammars_for(request_id).matcher(params.structured_outputs,
                                                      self._compiled.pop(request_id, None))

    def _validate_prompt(self, request_id: str, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt for {request_id!r} is a string but the model has no "
                                 "tokenizer.json: pass token ids")
            prompt = self.tokenizer.encode(prompt, add_special_tokens=True)  # BOS, if any
        if isinstance(prompt, torch.Tensor) and prompt.device.type != "cpu":
            # Reading it would wait for the device, step in flight included: a chain break.
            raise ValueError(f"prompt_token_ids for {request_id!r} is a tensor on "
                             f"{prompt.device}: pass it on the CPU (or as a list)")
        if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):
            prompt = prompt.tolist()  # a 1-D numpy array or CPU tensor; its ints are checked below
        # Plain ints first: the numbers.Integral check is an ABC lookup per token, 5-10 ms
        # of host time for a batch of 64 x 128-token prompts (the bench's e2e admission).
        if not isinstance(prompt, (list, tuple)) or not (
                all(type(t) is int for t in prompt)
                or all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                       for t in prompt)):
            raise ValueError(f"prompt_token_ids for {request_id!r} must be a list (or 1-D array) "
                             f"of ints, got {type(prompt).__name__}")
        prompt = list(map(int, prompt))  # the engine's own copy; numpy integers become ints
        if not prompt:
            raise ValueError(f"prompt_token_ids for {request_id!r} is empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"prompt_token_ids for {request_id!r} holds token id {bad}, "
                             f"outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids for {request_id!r} has {len(prompt)} tokens; "
                             f"max_model_len={self.max_model_len} leaves no room to generate")
        return prompt

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        """A request that can outgrow the whole KV cache would stall forever once it is alone:
        paused, evicted, and never readmitted. Refuse it now. Speculative steps write K
        positions past the last token, so those count too."""
        longest = min(prompt_len + max_tokens, self.max_model_len) + self.runner.k
        need = self.scheduler.blocks_for(longest)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {request_id!r}: prompt ({prompt_len} tokens) + max_tokens="
                f"{max_tokens} needs {need} KV blocks, the cache has {self.pool.num_blocks}: "
                f"lower max_tokens or raise num_kv_blocks")

    def abort(self, request_id: str) -> None:
        self._check_open()
        req = self.requests.get(request_id)
        if req is None or req.finished:
            raise ValueError(f"request_id={request_id!r} is not a running or waiting request")
        if req.status in (Status.WAITING, Status.PAUSED, Status.PREFILLING):
            self.scheduler.remove_waiting(req)
        req.finish("abort")
        self.scheduler.release(req)  # a running row leaves the batch at the next plan
        self._aborted.append(req)

    def stats_summary(self) -> dict:
        """Throughput and KV figures for logging, from host-side counters only."""
        st, sc = self.stats, self.scheduler.stats
        return dict(steps=st.steps, tokens=st.tokens, chain_breaks=st.chain_breaks,
                    idle_drains=st.idle_drains,
                    mean_batch=st.batch_size_sum / max(st.steps, 1),
                    batch_rows=st.batch_size_sum,
                    running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                    prefilling=len(self.scheduler.prefilling),
                    prefill_chunks=sc.prefill_chunks,
                    paused=len(self.scheduler.paused), kv_used=self.pool.num_used,
                    kv_total=self.pool.num_blocks, pauses=sc.pauses, evictions=sc.evictions,
                    admitted=sc.admitted, prefix_query_tokens=sc.prefix_query_tokens,
                    prefix_hit_tokens=sc.prefix_hit_tokens, cached_blocks=self.pool.num_cached,
                    **self._memory_figures)

    def has_unfinished(self) -> bool:
        if self._closed:
            return False
        return (any(not r.finished for r in self.requests.values()) or bool(self.in_flight)
                or bool(self._aborted))

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._check_open()
        try:
            return self._step()
        except BaseException:
            self._unblock_device()
            raise

    def _unblock_device(self) -> None:
        """After an error (or Ctrl-C) mid-step: lets every step that waits for its masks go on,
        with the masks the host can still fill, rather than leave the GPU spinning until the
        wait's deadline traps and takes the process's CUDA context with it."""
        gate = self.runner.mask_gate if self.runner is not None else None
        if gate is None or gate.released == gate.issued:
            return
        try:
            for step in self.in_flight:
                self._release_masks(step)
        except Exception:  # noqa: BLE001 -- a half-read step's masks may not fill; go on
            pass
        gate.release_through(gate.issued)

    def _step(self) -> list[RequestOutput]:
        touched: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted = []
        if self._all_rows_may_end_in_flight():
            self.stats.settles += 1
            self._reconcile_until(0, touched)
        elif self.runner.mask_gate is None and self._grammar_in_flight():
            self.stats.grammar_waits += 1  # its grammar rows' next masks need its tokens
            self._reconcile_until(0, touched)
        plan = self.scheduler.schedule(self._step_id)
        if not plan.empty:
            self._launch(plan, touched)
        elif plan.delta is not None:  # every row left: nothing runs, but the rows turn inert
            self.runner.apply_delta(plan.delta)
        depth = 1 if self.config.async_scheduling and not plan.empty else 0
        if self.config.async_scheduling and plan.empty and self.in_flight:
            self.stats.idle_drains += 1
        self._reconcile_until(depth, touched)
        outputs = [r.take_output() for r in touched.values()]
        for r in touched.values():
            if r.finished:
                self.requests.pop(r.request_id, None)
        return outputs

    def _reconcile_until(self, depth: int, touched: dict[str, Request]) -> None:
        """Reads the oldest steps in flight until `depth` remain. The oldest step left gets its
        grammar masks now: every step before it has been read, so its matchers are current."""
        while len(self.in_flight) > depth:
            step = self.in_flight.popleft()
            self._release_masks(step)  # (sync mode: the step just launched waits for them)
            for req in self._reconcile(step):
                touched[req.request_id] = req
        if self.in_flight:
            self._release_masks(self.in_flight[0])

    def _release_masks(self, step: _InFlight) -> None:
        """Fills the masks of a step that waits for them on the device (capture/mask_gate.py)
        and lets it go on."""
        gate, ticket = self.runner.mask_gate, step.launched.mask_ticket
        if ticket and gate.pending(ticket):
            fill_grammar_rows(gate.host_masks, gate.host_flags, step.plan.rows, self._grammars)
            gate.release(ticket)

    def _grammar_in_flight(self) -> bool:
        return any(f.plan.variant.grammar for f in self.in_flight)

    def _all_rows_may_end_in_flight(self) -> bool:
        """Under speculation a step emits 1..K+1 tokens, so the host cannot tell whether the
        step in flight ends a row by length. When it may end every row and nobody waits, the
        next step would most likely make only dropped tokens (a whole iteration at batch 1):
        read the step in flight first, at the cost of one host round trip."""
        if not (self.config.async_scheduling and self.runner.k and self.in_flight):
            return False
        sched = self.scheduler
        if sched.waiting or sched.paused or not sched.running:
            return False
        return all(r.may_end_in_flight for r in sched.running)

    def _launch(self, plan: Plan, touched: dict[str, Request]) -> None:
        waits = self.runner.host_waits()
        if waits > self._waits_seen:
            self.stats.chain_breaks += 1
        self._waits_seen = waits
        self.stats.batch_size_sum += len(plan.rows)
        held = self._held_grammar_rows(plan)
        masks = None
        if plan.variant.grammar and not self.runner.takes_masks_later(
                plan.delta, plan.prefills, plan.bucket, plan.variant):
            if self.runner.mask_gate is not None and self._grammar_in_flight():
                # an eager step under a MaskGate: its masks follow the step in flight's tokens
                self.stats.grammar_waits += 1
                self._reconcile_until(0, touched)
            masks = grammar_rows(plan.rows, self._grammars, held)
        launched = self.runner.launch(plan.delta, plan.prefills, plan.bucket, plan.variant,
                                      masks)
        # Each request the step runs, with the fewest and most tokens it emits for it: the
        # prompt chunks (one token for a prompt's last), then the decode rows. A mixed step gives
        # the rows its chunks join their first token only: they decode from the next step on.
        rows = [(r, c.samples, c.samples) for r, c in zip(plan.prefill_requests, plan.prefills)]
        rows += [(r, *self._decode_tokens(r, held)) for r in plan.rows[:launched.num_decode]]
        for req, fewest, most in rows:
            req.launched(plan.step_id, fewest, most)
        self.in_flight.append(_InFlight(plan, launched, rows))
        self._step_id += 1
        self.stats.steps += 1

    def _held_grammar_rows(self, plan: Plan) -> frozenset[str]:
        """Speculative steps: the grammar rows that join with a sampled first token. Their
        verify emits nothing this step: its mask would follow that token (structured.py)."""
        if not (self.runner.k and plan.variant.grammar):
            return frozenset()
        return frozenset(r.request_id for r, c in zip(plan.prefill_requests, plan.prefills)
                         if c.samples and r.grammar is not None)

    def _decode_tokens(self, req: Request, held: frozenset[str]) -> tuple[int, int]:
        """The fewest and most tokens a decode row emits this step: 1 without speculation,
        1..K+1 with it; a grammar row takes no drafts (1), and a held one emits none."""
        if req.grammar is None or not self.runner.k:
            return 1, self.runner.k + 1
        return (0, 0) if req.request_id in held else (1, 1)

    def _reconcile(self, step: _InFlight) -> list[Request]:
        """Reads step's tokens and applies them. A row that finished earlier also ran in this
        step (it was launched before the host knew): its tokens are dropped here."""
        plan = step.plan
        res = self.runner.fetch(step.launched)
        chunks = len(plan.prefills)  # their rows come first, then the decode rows'
        wants = [req.params.logprobs for req, _, _ in step.rows]
        emitted = (_row_tokens(res.prefill, [c.samples for c in plan.prefills], wants[:chunks],
                               res.with_logprobs)
                   + _row_tokens(res.decode, res.decode.counts.tolist(), wants[chunks:],
                                 res.with_logprobs))
        if res.prompt is not None:
            _prompt_logprobs(plan, res.prompt)
        touched = []
        for (req, fewest, most), (tokens, logprobs) in zip(step.rows, emitted):
            n = req.reconciled(fewest, most, tokens, logprobs)
            if n:
                self.stats.tokens += n
                touched.append(req)
                if req.finished:
                    self.scheduler.release(req)
        self.scheduler.retire(plan.step_id)
        return touched


def _row_tokens(rows: ResultRows, counts: list[int], wants: list[int | None],
                with_logprobs: bool) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    """Each row's tokens (the first counts[i]), and their TokenLogprobs with the top wants[i]
    alternatives where the request asked for logprobs."""
    toks = rows.tokens.tolist()
    if not with_logprobs or all(w is None for w in wants):
        return [(t[:c], None) for t, c in zip(toks, counts)]
    width = max(w for w in wants if w is not None)
    lp = rows.logprob.tolist()
    top_lp = rows.top_logprobs[:, :, :width].tolist()
    top_ids = rows.top_ids[:, :, :width].tolist()
    return [(toks[i][:c], None if w is None else [
                TokenLogprob(toks[i][j], lp[i][j], dict(zip(top_ids[i][j][:w], top_lp[i][j][:w])))
                for j in range(c)])
            for i, (c, w) in enumerate(zip(counts, wants))]


def _prompt_logprobs(plan: Plan, values: tuple) -> None:
    """Hands each chunk that asked its share of the step's prompt logprobs."""
    chosen, top_vals, top_ids = (v.tolist() for v in values)
    at = 0
    for req, chunk in zip(plan.prefill_requests, plan.prefills):
        n = len(chunk.logprob_targets or ())
        if n:
            req.set_prompt_logprobs(chunk.start, chosen[at:at + n], top_vals[at:at + n],
                                    top_ids[at:at + n])
            at += n


def _apply_manifest(cfg: EngineConfig) -> None:
    """Takes the buckets (within the graph memory budget) that tools/capture.py checked."""
    from .capture.manifest import Manifest, kernel_set

    m = Manifest.load(cfg.manifest)
    if m.model != cfg.model:
        raise ValueError(f"manifest={cfg.manifest!r} was built for model {m.model!r}, "
                         f"not {cfg.model!r}")
    kernels = kernel_set(cfg.projections, cfg.batch_invariant)
    if m.kernels != kernels:
        raise ValueError(f"manifest={cfg.manifest!r} was captured with the {m.kernels!r} "
                         f"kernels, this engine uses {kernels!r}: rebuild it with "
                         "tools/capture.py --projections / --batch-invariant")
    if m.triton_cache_dir and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = m.triton_cache_dir
    cfg.buckets = m.buckets_within(cfg.graph_memory_mib)
    cfg.max_batch = min(cfg.max_batch, max(cfg.buckets))
    cfg.buckets = [b for b in cfg.buckets if b <= cfg.max_batch]
