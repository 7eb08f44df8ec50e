"""ModelRunner: tensors in, tokens out. It owns the model, the KV cache and the DecodeState, and
launches steps; it decides nothing about which request runs (that is the scheduler's job)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .capture.iteration import SampleOut, decode_iteration
from .capture.mixed import mixed_step
from .capture.prefill import PrefillMeta, pack_prefill
from .capture.spec_iteration import DraftModel, spec_iteration
from .capture.staging import H2DRing, ResultMailbox
from .capture.state import DecodeState, pack_delta
from .model import KVCache, LlamaModel
from .outputs import TokenLogprob
from .plan import MAX_PREFILL_SEQS, PrefillChunk, StepDelta, Variant

Emitted = list[tuple[int, TokenLogprob | None]]  # the tokens one row produced in one step


@dataclass
class _D2HSlot:
    packed: torch.Tensor  # [rows, W + 1]: tokens then count (DecodeState.out_packed)
    tokens: torch.Tensor  # [rows, W] view: decode rows first, then prefill rows
    count: torch.Tensor  # [rows] view
    logprob: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    event: object | None = None


@dataclass
class Launched:
    """A step on the device whose results the host has not read yet."""

    slot: int
    prefill_counts: list[int]  # tokens each prefill chunk sampled (1 for a prompt's last)
    num_decode: int
    with_logprobs: bool
    mailbox_slot: int | None = None  # where the decode rows' tokens are (ResultMailbox)


@dataclass
class StepTokens:
    prefill: list[Emitted]  # one per PrefillChunk, in launch order
    decode: list[Emitted]  # one per row 0..num_decode-1


# Decode tokens reach the host through ResultMailbox (the iteration's last kernel stores them in
# pinned memory) instead of a D2H copy after each replay; decode_variants `d2h-copy` sets False.
ZERO_COPY_RESULTS = True


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, max_rows: int, max_model_len: int,
                 block_size: int, scratch_block: int, draft: DraftModel | None = None,
                 num_spec_tokens: int = 0, d2h_slots: int = 4,
                 token_buckets: list[int] = ()):
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
                                 self.device, tokens_per_step=w)
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
        cuda = self.device.type == "cuda"
        n = self.state.out_top_ids.shape[-1]
        rows = 2 * (max_rows + 1)  # prefill results sit after the decode rows: one copy each

        def pinned(*shape, dtype=torch.int64):
            return torch.empty(*shape, dtype=dtype, pin_memory=cuda)

        def slot() -> _D2HSlot:
            packed = pinned(rows, w + 1)
            return _D2HSlot(packed, packed[:, :w], packed[:, w],
                            pinned(rows, w, dtype=torch.float32),
                            pinned(rows, w, n, dtype=torch.float32), pinned(rows, w, n))

        self._d2h = [slot() for _ in range(d2h_slots)]
        self.mailbox = (ResultMailbox(max_rows + 1, w + 1, self.device, d2h_slots)
                        if cuda and ZERO_COPY_RESULTS else None)
        self._next_slot = 0
        self._d2h_waits = 0
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
        if self.mailbox is not None:
            self.mailbox.publish(self.state.out_packed[:bucket])
            self.mailbox.ran()

    # -- launch -------------------------------------------------------------------------------

    def launch(self, delta: StepDelta | None, prefills: list[PrefillChunk], bucket: int,
               variant: Variant) -> Launched:
        """Enqueues: delta, the prefill chunks, one decode iteration over `bucket` rows (or,
        for a runner that mixes, one forward over the chunks and the decode rows), and the copy
        of the results to pinned host memory. Returns without waiting."""
        if delta is not None:
            self.apply_delta(delta)
        mixed = bool(prefills) and self.mixed
        num_decode = self.num_rows
        pre = None
        if mixed:  # the rows its chunks join (the last ones) get their first token only
            num_decode -= sum(c.row is not None for c in prefills)
        elif prefills:
            pre = self._prefill(prefills, variant.logprobs)
        mailbox_slot = None
        if num_decode or mixed:
            if self.mailbox is not None:
                mailbox_slot = self.mailbox.next_slot()
            with self._timeline_span(bool(prefills)):
                if mixed:
                    pre = self._prefill(prefills, variant.logprobs, num_decode)
                elif self.graphs is not None and self.graphs.has(bucket, variant):
                    self.graphs.replay(bucket, variant)
                else:
                    self.iterate(bucket, variant)
        launched = self._copy_out(pre, [p.samples for p in prefills], num_decode,
                                  variant.logprobs)
        launched.mailbox_slot = mailbox_slot
        return launched

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

    def apply_delta(self, delta: StepDelta) -> None:
        """Enqueues the batch change alone. Also for a step that runs nothing: rows that left
        must turn inert on the device before any later bucket runs them again."""
        ints, floats = pack_delta(delta, self.max_rows)
        d_ints, d_floats = self.h2d.put(ints, floats)
        self.state.apply_delta(delta, d_ints, d_floats)
        self.num_rows = delta.num_rows

    def _prefill(self, chunks: list[PrefillChunk], with_logprobs: bool,
                 num_decode: int | None = None) -> SampleOut:
        """One prefill step over the chunks, or with num_decode given a mixed step (the
        chunks after that many decode rows). On CUDA, padded to a token bucket over the static
        buffer: a graph replay, or eagerly the very shapes the graph runs (so graphs and eager
        agree bit for bit). On the CPU, eager at the exact sizes."""
        lead = num_decode or 0
        num_tokens = lead + sum(len(c.token_ids) for c in chunks)
        st = self.state
        tokens = None
        if self.prefill_buffer is not None and len(chunks) <= MAX_PREFILL_SEQS:
            tokens = next((t for t in self.token_buckets if t >= num_tokens), None)
        if tokens is None:
            cols = max(len(c.blocks) for c in chunks)
            ints = pack_prefill(chunks, num_tokens, len(chunks), cols, self.block_size,
                                self.scratch_block, st.inert_row, lead)
            d, _ = self.h2d.put(ints, [])
            return self._run_prefill(PrefillMeta.view(d, num_tokens, len(chunks), cols),
                                     with_logprobs, lead)
        ints = pack_prefill(chunks, tokens, MAX_PREFILL_SEQS, st.max_cols, self.block_size,
                            self.scratch_block, st.inert_row, lead)
        if self.graphs is not None and (tokens, with_logprobs) in self.graphs.prefill:
            self.h2d.put_into(ints, self.prefill_buffer)
            out = self.graphs.replay_prefill(tokens, with_logprobs)
            if self.mixed and self.mailbox is not None:
                self.mailbox.ran()
            return out
        return self.prefill_padding(tokens, with_logprobs, ints)

    def prefill_padding(self, tokens: int, with_logprobs: bool,
                        ints: np.ndarray | None = None) -> SampleOut:
        """The prefill (or mixed step) of `tokens`' bucket over the static buffer, as its graph
        runs it, eagerly. With no `ints`, one of nothing but padding (it writes only the
        scratch block and the inert row): what GraphSet.capture warms up and captures."""
        st = self.state
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a capture reads, never fills
            if ints is None:
                ints = pack_prefill([], tokens, MAX_PREFILL_SEQS, st.max_cols, self.block_size,
                                    self.scratch_block, st.inert_row)
            self.h2d.put_into(ints, self.prefill_buffer)
        meta = PrefillMeta.view(self.prefill_buffer, tokens, MAX_PREFILL_SEQS, st.max_cols)
        return self._run_prefill(meta, with_logprobs, min(self.max_rows, tokens))

    def _run_prefill(self, meta: PrefillMeta, with_logprobs: bool,
                     decode_rows: int) -> SampleOut:
        """Eager: the mixed step with a decode part of decode_rows rows, or the chunks alone
        (a speculative runner)."""
        st = self.state
        rows = decode_rows if self.mixed else 0
        out = mixed_step(self.model, st, self.kv, meta, rows, self.block_size, with_logprobs,
                         self.draft)
        if not self.mixed:
            return out
        if self.mailbox is not None:  # every run publishes, so the slot counter stays in step
            self.mailbox.publish(st.out_packed[:max(decode_rows, 1)])
            self.mailbox.ran()
        return out

    def _copy_out(self, pre, prefill_counts: list[int], num_decode: int,
                  with_logprobs: bool) -> Launched:
        num_prefill = len(prefill_counts)
        i = self._next_slot
        self._next_slot = (i + 1) % len(self._d2h)
        slot = self._d2h[i]
        if slot.event is not None and not slot.event.query():
            # The host reads every slot before it is reused (reconcile runs one step behind and
            # the ring is deeper than that), so this should never happen; count it if it does.
            self._d2h_waits += 1
            slot.event.synchronize()
        st, r = self.state, self.max_rows + 1
        nb = self.device.type == "cuda"
        # (host, decode rows' source, prefill rows' source): tokens and counts in one copy
        pairs = [(slot.packed, None if self.mailbox else st.out_packed, None),
                 (slot.tokens, None, pre.tokens if pre else None)]
        if with_logprobs:
            pairs += [(slot.logprob, st.out_logprob, pre.logprob if pre else None),
                      (slot.top_logprobs, st.out_top_logprobs, pre.top_logprobs if pre else None),
                      (slot.top_ids, st.out_top_ids, pre.top_ids if pre else None)]
        for host, dec, pf in pairs:
            if num_decode and dec is not None:
                host[:num_decode].copy_(dec[:num_decode], non_blocking=nb)
            if pf is not None:  # a captured prefill's outputs are padded: its first rows
                host[r:r + num_prefill, 0].copy_(pf[:num_prefill], non_blocking=nb)
        if nb:
            if slot.event is None:
                slot.event = torch.cuda.Event()
            slot.event.record()
        return Launched(i, prefill_counts, num_decode, with_logprobs)

    def host_waits(self) -> int:
        """Times a launch had to wait for a staging slot's earlier copy (should stay 0)."""
        return self.h2d.stats.waits + self._d2h_waits

    # -- results ------------------------------------------------------------------------------

    def fetch(self, launched: Launched, top_n: tuple[list, list] | None = None) -> StepTokens:
        """Waits for the step's results (normally long arrived) and returns them as Python.
        top_n: per prefill row and per decode row, how many top logprobs the request wants
        (None: no logprobs for that row); only those are converted. Not given: all of them."""
        slot = self._d2h[launched.slot]
        if slot.event is not None and not slot.event.query():
            t0 = time.perf_counter()
            slot.event.synchronize()
            self.wait_seconds += time.perf_counter() - t0
        r = self.max_rows + 1

        def rows(tokens: torch.Tensor, start: int, n: int, counts: list[int],
                 wants: list) -> list[Emitted]:
            toks = tokens[start:start + n].tolist()
            if not launched.with_logprobs or not any(w is not None for w in wants):
                return [[(t, None) for t in toks[i][:c]] for i, c in enumerate(counts)]
            width = max(w for w in wants if w is not None)
            lp = slot.logprob[start:start + n].tolist()
            tv = slot.top_logprobs[start:start + n, :, :width].tolist()
            ti = slot.top_ids[start:start + n, :, :width].tolist()
            return [[(toks[i][j], None if w is None else TokenLogprob(
                        toks[i][j], lp[i][j], dict(zip(ti[i][j][:w], tv[i][j][:w]))))
                     for j in range(c)] for i, (c, w) in enumerate(zip(counts, wants))]

        counts = launched.prefill_counts
        n_dec = launched.num_decode
        if top_n is None:  # every row, all the top logprobs the step computed
            full = slot.top_ids.shape[-1] if launched.with_logprobs else None
            top_n = ([full] * len(counts), [full] * n_dec)
        pre_n, dec_n = top_n
        dec_tokens, dec_count = slot.tokens, slot.count
        if launched.mailbox_slot is not None:
            packed = self.mailbox.ring[launched.mailbox_slot]
            dec_tokens, dec_count = packed[:, :-1], packed[:, -1]
        return StepTokens(prefill=rows(slot.tokens, r, len(counts), counts, pre_n),
                          decode=rows(dec_tokens, 0, n_dec, dec_count[:n_dec].tolist(), dec_n))
