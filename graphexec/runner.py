"""ModelRunner: tensors in, tokens out. It owns the model, the KV cache and the DecodeState, and
launches steps; it decides nothing about which request runs (that is the scheduler's job)."""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ContextManager

import numpy as np
import torch

from .capture.iteration import SampleOut, decode_iteration
from .capture.mask_gate import MaskGate
from .capture.mixed import mixed_step
from .capture.prefill import PrefillMeta, pack_prefill
from .capture.results import ResultRing, StepResults
from .capture.spec_iteration import DraftModel, spec_iteration
from .capture.staging import H2DRing
from .capture.penalties import pack_init
from .capture.prompt_logprobs import pack_rows, to_pinned
from .capture.state import DecodeState, pack_delta
from .model import KVCache, LlamaModel
from .plan import MAX_PREFILL_SEQS, PrefillChunk, StepDelta, Variant

_MIRROR_NOTHING = nullcontext()


@dataclass
class Launched:
    """A step on the device whose results the host has not read yet."""

    slot: int  # its slot of the ResultRing
    num_prefill: int  # prompt chunks it ran
    num_decode: int  # rows it decoded: rows [0, num_decode) of the batch
    with_logprobs: bool
    # prompt logprobs of its chunks, in pinned memory once the step's event fired
    prompt: tuple[torch.Tensor, ...] | None = None
    # its ticket at the runner's MaskGate: the step waits on the device for its grammar masks
    # until the host releases them (0: none to wait for)
    mask_ticket: int = 0


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, max_rows: int, max_model_len: int,
                 block_size: int, scratch_block: int, draft: DraftModel | None = None,
                 num_spec_tokens: int = 0, result_slots: int = 4,
                 token_buckets: list[int] = (), defer_masks: bool = False):
        self.model, self.kv = model, kv
        self.draft, self.k = draft, num_spec_tokens
        # A step with prompt chunks runs them and the decode rows in one forward
        # (capture/mixed.py). The speculative iteration keeps its own forward after the prefill.
        self.mixed = draft is None
        self.device = model.device
        self.block_size = block_size
        self.max_rows = max_rows
        # A speculative step may write K positions past the context limit before the host
        # trims: those columns exist and point at the scratch block.
        max_blocks = -(-(max_model_len + num_spec_tokens) // block_size)
        w = num_spec_tokens + 1
        self.state = DecodeState(max_rows, max_blocks, model.config.vocab_size, scratch_block,
                                 self.device, tokens_per_step=w, penalties=True)
        # defer_masks: grammar steps launch before their masks exist (capture/mask_gate.py)
        self.mask_gate = (MaskGate(self.state.grammar_rows, self.state.num_rows,
                                   -(-model.config.vocab_size // 32)) if defer_masks else None)
        self.state.mask_gate = self.mask_gate
        # A step may stage two copies (its delta and its prefill): eight slots keep the one
        # being rewritten two steps behind the step in flight.
        self.h2d = H2DRing(self.device, num_slots=8)
        self.scratch_block = scratch_block
        # The static buffer captured prefill graphs read (capture/prefill.py); sized for the
        # largest token bucket (EngineConfig.token_buckets: the whole budget of a step).
        self.token_buckets = list(token_buckets)
        self.prefill_buffer = torch.zeros(
            PrefillMeta.size(token_buckets[-1], MAX_PREFILL_SEQS, self.state.max_cols),
            dtype=torch.int64, device=self.device
        ) if self.device.type == "cuda" and token_buckets else None
        self.results = ResultRing(max_rows + 1, w, self.state.out_top_ids.shape[-1],
                                  self.device, result_slots)
        self.graphs = None  # capture.graphs.GraphSet when CUDA graphs are on
        self.num_rows = 0  # rows holding a request, as of the last launch
        # Benchmarks set this to a list: (start, end, had_prefill) per decode iteration or
        # mixed step, the events around it (a speculative runner's prefill runs just before
        # `start`).
        self.timeline: list | None = None
        self.wait_seconds = 0.0  # host time spent blocked on results in fetch()

    def iterate(self, bucket: int, variant: Variant) -> None:
        """One decode iteration over the first `bucket` rows, eager (also what graphs capture)."""
        if self.draft is None:
            decode_iteration(self.model, self.state, self.kv, bucket, self.block_size,
                             variant)
        else:
            spec_iteration(self.model, self.draft, self.state, self.kv, bucket, self.block_size,
                           self.k, variant)
        self.results.publish(self.state.out_packed[:bucket])

    # -- launch -------------------------------------------------------------------------------

    def launch(self, delta: StepDelta | None, prefills: list[PrefillChunk], bucket: int,
               variant: Variant, grammar_rows: np.ndarray | None = None) -> Launched:
        """Enqueues: delta, the prefill chunks, one decode iteration over `bucket` rows (or,
        for a runner that mixes, one forward over the chunks and the decode rows), and the copy
        of the results to the step's pinned slot. Returns without waiting. grammar_rows: with
        variant.grammar, each row's token mask and flag (DecodeState.grammar_rows' layout);
        None for a step that `takes_masks_later`: it waits for the host to release them."""
        with self._mirrored("launch", delta, prefills, bucket, variant, grammar_rows):
            if delta is not None:
                self._apply_delta(delta)
            if grammar_rows is not None:
                self.h2d.put_into(grammar_rows.reshape(-1), self.state.grammar_rows.view(-1))
            slot = self.results.take()
            num_decode, samples = self._run(prefills, bucket, variant)
            # the replay that waits is enqueued: its ticket is the next one
            ticket = self.mask_gate.arm() if variant.grammar and grammar_rows is None else 0
            prompt = to_pinned(samples.prompt) if samples and samples.prompt else None
            self._copy_out(slot, samples, len(prefills), num_decode, variant.logprobs)
        return Launched(slot, len(prefills), num_decode, variant.logprobs, prompt, ticket)

    def takes_masks_later(self, delta: StepDelta | None, prefills: list[PrefillChunk],
                          bucket: int, variant: Variant) -> bool:
        """Whether a grammar step can be launched before its masks exist: under a MaskGate
        (capture/mask_gate.py), one that replays a captured graph, decode or mixed."""
        if self.mask_gate is None or self.graphs is None:
            return False
        if not prefills:
            return self.graphs.has(bucket, variant)
        num_rows = delta.num_rows if delta is not None else self.num_rows
        lead = num_rows - sum(c.row is not None for c in prefills)  # as _run counts them
        tokens = self._token_bucket(prefills, lead)
        return (tokens, variant.logprobs, variant.penalties, variant.grammar) in self.graphs.prefill

    def apply_delta(self, delta: StepDelta) -> None:
        """Enqueues the batch change alone. Also for a step that runs nothing: rows that left
        must turn inert on the device before any later bucket runs them again."""
        with self._mirrored("delta", delta):
            self._apply_delta(delta)

    def _mirrored(self, kind: str, *args) -> ContextManager:
        """What a launch ("launch") or a lone delta ("delta") runs inside. A tensor-parallel
        runner sends the call to its workers here (graphexec/parallel/runner.py)."""
        return _MIRROR_NOTHING

    def _apply_delta(self, delta: StepDelta) -> None:
        pen = self.state.penalties
        slots = pen.assign(delta) if pen is not None else None
        ints, floats = pack_delta(delta, self.max_rows, slots)
        d_ints, d_floats = self.h2d.put(ints, floats)
        self.state.apply_delta(delta, d_ints, d_floats)
        init = pack_init(delta, slots) if slots else None
        if init is not None:  # joining rows that use penalties: their slots' first contents
            pen.apply_init(init, *self.h2d.put(init.ints, init.floats))
        self.num_rows = delta.num_rows

    def _run(self, prefills: list[PrefillChunk], bucket: int,
             variant: Variant) -> tuple[int, SampleOut | None]:
        """Enqueues the step's forward passes, which publish the decode rows' results exactly
        once. Returns how many rows it decoded and the chunks' samples."""
        lp, pen = variant.logprobs, (variant.penalties, variant.grammar)
        if prefills and self.mixed:
            # the rows its chunks join (the last ones) get their first token only
            num_decode = self.num_rows - sum(c.row is not None for c in prefills)
            with self._timeline_span(True):
                return num_decode, self._mixed_step(prefills, lp, num_decode, *pen)
        # chunks alone; a joining row's first token gets its penalties and mask here
        samples = self._mixed_step(prefills, lp, None, *pen) if prefills else None
        if not self.num_rows:  # nothing decodes; the publish keeps the slot counter in step
            self.results.publish(self.state.out_packed[:1])
            return 0, samples
        with self._timeline_span(bool(prefills)):
            if self.graphs is not None and self.graphs.has(bucket, variant):
                self.graphs.replay(bucket, variant)
            else:
                self.iterate(bucket, variant)
        return self.num_rows, samples

    @contextmanager
    def _timeline_span(self, admits: bool):
        """CUDA events around what it encloses, kept in self.timeline when benchmarks ask."""
        if self.timeline is None:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.timeline.append((start, end, admits))
        yield
        end.record()

    def _mixed_step(self, chunks: list[PrefillChunk], with_logprobs: bool,
                    num_decode: int | None = None, penalties: bool = False,
                    grammar: bool = False) -> SampleOut:
        """One forward over the chunks after num_decode decode rows (a mixed step), or with
        num_decode None over the chunks alone (a speculative runner's, before its iteration).
        On CUDA, padded to a token bucket over the static buffer: a graph replay, or eagerly
        the very shapes the graph runs (so graphs and eager agree bit for bit). On the CPU,
        eager at the exact sizes. Returns the chunks' samples."""
        lead = num_decode or 0
        num_tokens = lead + sum(len(c.token_ids) for c in chunks)
        st = self.state
        prompt = any(c.logprob_targets for c in chunks)
        tokens = self._token_bucket(chunks, lead)
        if tokens is None:
            cols = max(len(c.blocks) for c in chunks)
            ints = pack_prefill(chunks, num_tokens, len(chunks), cols, self.block_size,
                                self.scratch_block, st.inert_row, lead)
            d, _ = self.h2d.put(ints, [])
            rows = None
            if prompt:
                at, targets = pack_rows(chunks, lead)
                d_rows, _ = self.h2d.put(at + targets, [])
                rows = (d_rows[:len(at)], d_rows[len(at):])
            return self._run_mixed_step(PrefillMeta.view(d, num_tokens, len(chunks), cols),
                                        with_logprobs, lead, penalties, rows, grammar)
        ints = pack_prefill(chunks, tokens, MAX_PREFILL_SEQS, st.max_cols, self.block_size,
                            self.scratch_block, st.inert_row, lead)
        key = (tokens, with_logprobs, penalties, grammar)
        if self.graphs is not None and key in self.graphs.prefill:
            self.h2d.put_into(ints, self.prefill_buffer)
            return self.graphs.replay_prefill(*key)
        return self.padded_mixed_step(tokens, with_logprobs, ints, penalties, grammar)

    def _token_bucket(self, chunks: list[PrefillChunk], lead: int) -> int | None:
        """The token bucket a step of these chunks after `lead` decode rows pads to; None: it
        runs eagerly at its exact size (the CPU, too many chunks, prompt logprobs, which need
        every position's logits: a shape no graph holds)."""
        if (self.prefill_buffer is None or len(chunks) > MAX_PREFILL_SEQS
                or any(c.logprob_targets for c in chunks)):
            return None
        num_tokens = lead + sum(len(c.token_ids) for c in chunks)
        return next((t for t in self.token_buckets if t >= num_tokens), None)

    def padded_mixed_step(self, tokens: int, with_logprobs: bool,
                          ints: np.ndarray | None = None,
                          penalties: bool = False, grammar: bool = False) -> SampleOut:
        """The mixed step (or a speculative runner's chunks alone) of `tokens`' bucket over the
        static buffer, as its graph runs it, eagerly. With no `ints`, one of nothing but
        padding (it writes only the scratch block and the inert row): what GraphSet.capture
        warms up and captures."""
        st = self.state
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a capture reads, never fills
            if ints is None:
                ints = pack_prefill([], tokens, MAX_PREFILL_SEQS, st.max_cols, self.block_size,
                                    self.scratch_block, st.inert_row)
            self.h2d.put_into(ints, self.prefill_buffer)
        meta = PrefillMeta.view(self.prefill_buffer, tokens, MAX_PREFILL_SEQS, st.max_cols)
        return self._run_mixed_step(meta, with_logprobs, min(self.max_rows, tokens), penalties,
                                    grammar=grammar)

    def _run_mixed_step(self, meta: PrefillMeta, with_logprobs: bool,
                        decode_rows: int, penalties: bool = False,
                        prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                        grammar: bool = False) -> SampleOut:
        """Eager: the mixed step with a decode part of decode_rows rows, or the chunks alone
        (a speculative runner)."""
        st = self.state
        rows = decode_rows if self.mixed else 0
        out = mixed_step(self.model, st, self.kv, meta, rows, self.block_size, with_logprobs,
                         self.draft, penalties, grammar, prompt_rows)
        if self.mixed:  # the decode rows' results, as the decode iteration publishes them
            self.results.publish(st.out_packed[:max(decode_rows, 1)])
        return out

    def _copy_out(self, i: int, samples: SampleOut | None, num_prefill: int, num_decode: int,
                  with_logprobs: bool) -> None:
        """Enqueues the copies of what the forward did not publish into slot i: the chunks'
        samples and the logprobs, each into contiguous pinned memory (ResultRing says why)."""
        slot, st, pre = self.results.slots[i], self.state, samples
        nb = self.device.type == "cuda"
        # tokens (the decode rows' are published), then the logprobs
        dec = (None, st.out_logprob, st.out_top_logprobs, st.out_top_ids)
        pf = (pre.tokens, pre.logprob, pre.top_logprobs, pre.top_ids) if pre else (None,) * 4
        for k in range(4 if with_logprobs else 1):
            if num_decode and dec[k] is not None:
                slot.decode[k][:num_decode].copy_(dec[k][:num_decode], non_blocking=nb)
            if pf[k] is not None:  # a captured prefill's outputs are padded: its first rows
                slot.prefill[k][:num_prefill].copy_(pf[k][:num_prefill], non_blocking=nb)
        self.results.record(i)

    def host_waits(self) -> int:
        """Times a launch had to wait for a staging or result slot's earlier step (stays 0)."""
        return self.h2d.stats.waits + self.results.waits

    # -- results ------------------------------------------------------------------------------

    def fetch(self, launched: Launched) -> StepResults:
        """Waits for the step's results (normally long arrived) and returns them: numpy views
        of its slot, valid until the slot is taken again (results.num_slots launches later)."""
        event = self.results.slots[launched.slot].event
        if event is not None:
            self.wait_seconds += self._wait(event)
        res = self.results.read(launched.slot, launched.num_decode, launched.num_prefill,
                                launched.with_logprobs)
        if launched.prompt is not None:
            res.prompt = tuple(t.numpy() for t in launched.prompt)
        return res

    def _wait(self, event: torch.cuda.Event) -> float:
        """Waits for a step's last copy; returns the seconds it waited."""
        if event.query():
            return 0.0
        t0 = time.perf_counter()
        event.synchronize()
        return time.perf_counter() - t0
