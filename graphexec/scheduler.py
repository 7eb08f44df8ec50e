"""Scheduler: who is in the batch for the next step, and which KV blocks they own.

Policy, no tensors. Each step it (1) drops rows that ended or surely end within the steps in
flight, (2) makes sure every running row owns the block its next write lands in (pausing, then
evicting, under KV pressure: see _make_room), (3) resumes paused rows, and (4) spends the step's
token budget (max_num_batched_tokens, less one token per decode row) on prompt chunks: first the
prompts already begun, then waiting requests in arrival order while rows and blocks allow. A
prompt longer than the budget is prefilled over several steps while the decode rows go on; on its
last chunk it samples its first token and joins the batch. The result is a Plan
(graphexec/plan.py): a StepDelta for the device, the prefill chunks to run and the rows at launch.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .block_pool import BlockPool, chain_hashes
from .config import EngineConfig
from .plan import (MAX_PREFILL_SEQS, NewRow, Plan, PrefillChunk, RowPenalties, StepDelta, Variant,
                   bucket_floor)
from .request import Request, Status


@dataclass
class SchedulerStats:
    evictions: int = 0
    pauses: int = 0
    resumed: int = 0
    admitted: int = 0
    prefill_chunks: int = 0  # chunks that did not end their prompt
    prefill_evictions: int = 0  # evictions of a request in the middle of its prefill
    prefix_query_tokens: int = 0  # prompt tokens admitted (recomputes included)
    prefix_hit_tokens: int = 0  # of those, tokens whose KV a cached block already held


class Scheduler:
    def __init__(self, pool: BlockPool, config: EngineConfig, spec_tokens: int = 0):
        self.pool = pool
        self.spec_tokens = spec_tokens  # K draft positions written past each row's input
        # Without speculation a step's chunks and decode rows share one forward
        # (capture/mixed.py), padded as a whole to a token bucket; a row its last chunk joins
        # decodes from the next step on.
        self.mixed = spec_tokens == 0
        self.block_size = config.block_size
        self.max_batch = config.max_batch
        self.buckets = config.buckets
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.token_buckets = config.token_buckets
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # row order of the DecodeState
        # Admitted, prompt KV partly written, no row yet; sorted by arrival. Each holds every
        # block its prompt and first decode step need, so a begun prefill never waits for KV.
        self.prefilling: list[Request] = []
        self.paused: list[Request] = []  # out of the batch, KV kept; sorted by arrival
        # (step id, blocks): freed once that step's results are reconciled, because until then
        # the device may still write them.
        self.deferred: list[tuple[int, list[int]]] = []
        self.stats = SchedulerStats()

    # -- queue --------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def remove_waiting(self, req: Request) -> None:
        """Takes a waiting, prefilling or paused request out of its queue (abort)."""
        for queue in (self.paused, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
                return

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # -- planning -----------------------------------------------------------------------------

    def schedule(self, step_id: int) -> Plan:
        self.paused = [r for r in self.paused if not r.finished]
        # Rows leave the batch when they ended, or when steps in flight are sure to end them by
        # length: async mode then runs no step whose tokens would all be dropped. Such a row
        # stays RUNNING, out of the batch, until its last step is reconciled and releases it.
        keep = [i for i, r in enumerate(self.running) if not r.finished and not r.ends_in_flight]
        row_map = list(keep)
        compacted = len(keep) != len(self.running)
        self.running = [self.running[i] for i in keep]
        paused, missing = self._make_room(row_map)
        compacted |= paused
        entries = self._reserve(missing)
        new_rows: list[NewRow] = []
        resumed = self._resume(new_rows, entries)
        prefills: list[PrefillChunk] = []
        prefill_requests: list[Request] = []
        self._prefill(new_rows, entries, prefills, prefill_requests)
        n_rows = len(self.running)
        delta = None
        if compacted or new_rows or entries:
            delta = StepDelta(num_rows=n_rows, row_map=row_map if compacted else None,
                              new_rows=new_rows, block_entries=entries)
        bucket = next((b for b in self.buckets if b >= n_rows), self.max_batch)
        self.stats.resumed += resumed
        return Plan(step_id=step_id, delta=delta, prefills=prefills,
                    prefill_requests=prefill_requests,
                    rows=list(self.running), bucket=bucket,
                    variant=self._variant())

    def _variant(self) -> Variant:
        logprobs = any(r.params.logprobs is not None for r in self.running)
        grammar = any(r.grammar is not None for r in self.running)
        # a speculative step masks its verify beside the penalties (capture/spec_controls.py)
        penalties = (grammar and self.spec_tokens > 0) or any(r.params.uses_penalties
                                                               for r in self.running)
        if self.spec_tokens and all(r.params.temperature == 0 for r in self.running):
            # filters: greedy ignores them
            return Variant(logprobs, filters=False, sampled=False, penalties=penalties,
                           grammar=grammar)
        # plain decoding ignores `filters`; the penalties and grammar variants are captured
        # with it on only
        return Variant(logprobs, filters=penalties or grammar or any(
                           r.top_k > 0 or r.params.top_p < 1 for r in self.running),
                       penalties=penalties, grammar=grammar)

    def _missing_blocks(self, req: Request) -> int:
        """Blocks the row lacks for every position its next step may write: from its next input
        (an upper bound while steps are in flight) through the K draft positions after it."""
        last = req.num_tokens - 1 + req.advance_bound + self.spec_tokens
        last = min(last, req.max_len - 1)  # past the limit writes go to the scratch block
        return max(0, last // self.block_size + 1 - len(req.blocks))

    def _make_room(self, row_map: list[int]) -> tuple[bool, list[int]]:
        """KV pressure policy. While the rows that need a new block outnumber the free blocks,
        pause the latest arrival among them: it keeps its KV and leaves the batch. When the
        batch is empty and nothing paused can resume, evict the latest paused arrival: its KV is
        freed and it is requeued to recompute prompt + output. Returns whether rows left, and
        the blocks each remaining row lacks (they now fit)."""
        changed = False
        missing = [self._missing_blocks(r) for r in self.running]
        while not self.pool.can_allocate(sum(missing)):
            short = [i for i, m in enumerate(missing) if m]
            v = max(short, key=lambda i: self.running[i].arrival)
            if self.prefilling and self.prefilling[-1].arrival > self.running[v].arrival:
                # a later arrival still prefilling gives its blocks back first (recompute)
                self.stats.prefill_evictions += 1
                self._evict(self.prefilling.pop())
                continue
            req = self.running.pop(v)
            del row_map[v]
            del missing[v]
            req.status = Status.PAUSED
            bisect.insort(self.paused, req, key=lambda r: r.arrival)
            self.stats.pauses += 1
            changed = True
        if not self.running and self.paused and not any(
                self._can_resume(r) for r in self.paused):
            settled = [r for r in self.paused if not r.in_flight]
            if settled:
                victim = settled[-1]
                self.paused.remove(victim)
                self._evict(victim)
        return changed, missing

    def _can_resume(self, req: Request) -> bool:
        return not req.in_flight and self.pool.can_allocate(self._missing_blocks(req))

    def _reserve(self, missing: list[int]) -> list[tuple[int, int, int]]:
        """Reserve one step ahead: each row gets the block its next write lands in."""
        entries = []
        for row, m in enumerate(missing):
            if not m:
                continue
            req = self.running[row]
            for block in self.pool.allocate(m):
                entries.append((row, len(req.blocks), block))
                req.blocks.append(block)
        return entries

    def _resume(self, new_rows: list[NewRow], entries: list[tuple[int, int, int]]) -> int:
        """Paused rows rejoin, oldest first among those whose last token is known and whose next
        blocks are free. Their KV is intact: they continue from their last token, no prefill."""
        n = 0
        for req in list(self.paused):
            if self._rows_taken() >= self.max_batch:
                break
            if not self._can_resume(req):
                continue  # a later row that fits may still go: no head-of-line deadlock
            self.paused.remove(req)
            req.blocks += self.pool.allocate(self._missing_blocks(req))
            self._add_row(req, new_rows, entries)
            new_rows[-1].input_id = req.output[-1]
            new_rows[-1].position = req.num_tokens - 1
            new_rows[-1].step = len(req.output)
            n += 1
        return n

    def _rows_taken(self) -> int:
        """Rows in the batch plus rows promised to prompts being prefilled."""
        return len(self.running) + len(self.prefilling)

    def _prefill(self, new_rows: list[NewRow], entries: list[tuple[int, int, int]],
                 chunks: list[PrefillChunk], requests: list[Request]) -> None:
        """Spends the step's token budget on prompt chunks, the prompts already begun first.
        Mixed steps: what the decode rows leave of max_num_batched_tokens (at least one token,
        since it exceeds max_batch); decode rows and chunks are padded to a token bucket
        together, and a chunk that fills the step fills the largest one. Speculative steps: cut
        to a captured prefill size, so a prompt cut into chunks pads none of them, and at least
        the smallest size, so prompts progress beside any batch."""
        decode_tokens = len(self.running) * (self.spec_tokens + 1)
        if self.mixed:  # the whole step is bucketed: a chunk may fill it to the budget
            budget = self.max_num_batched_tokens - decode_tokens
        else:
            budget = bucket_floor(self.token_buckets,
                                  self.max_num_batched_tokens - decode_tokens)
        for req in list(self.prefilling):
            if budget <= 0 or len(chunks) >= MAX_PREFILL_SEQS:
                return
            budget -= self._chunk(req, budget, new_rows, entries, chunks, requests)
        if self.paused:  # paused rows hold KV already: they go first
            return
        while (self.waiting and budget > 0 and len(chunks) < MAX_PREFILL_SEQS
               and self._rows_taken() < self.max_batch):
            req = self.waiting[0]
            if req.finished:
                self.waiting.pop(0)
                continue
            if req.in_flight:  # evicted while a step was out: its last tokens are not known yet
                break
            # the prompt, the first token, and what the first decode step may write after it
            need = self.blocks_for(min(req.num_tokens + 1 + self.spec_tokens, req.max_len))
            # evicted after sampling: rebuild the KV of all but its last token, which it
            # decodes on from
            ids = req.prompt + req.output[:-1]
            keys, hits = self._cached_prefix(ids)
            if req.params.prompt_logprobs is not None:  # every prompt position is computed
                hits = []
            # a cached block nobody holds is taken from the free list too
            from_free = sum(1 for b in hits if self.pool.refcount(b) == 0)
            if not self.pool.can_allocate(need - len(hits) + from_free):
                break
            self.waiting.pop(0)
            for b in hits:
                self.pool.take(b)
            req.blocks = hits + self.pool.allocate(need - len(hits))
            req.prefill_ids, req.block_keys = ids, keys
            req.num_computed = len(hits) * self.block_size
            self.stats.prefix_query_tokens += len(ids)
            self.stats.prefix_hit_tokens += req.num_computed
            req.status = Status.PREFILLING
            bisect.insort(self.prefilling, req, key=lambda r: r.arrival)
            self.stats.admitted += 1
            budget -= self._chunk(req, budget, new_rows, entries, chunks, requests)

    def _cached_prefix(self, ids: list[int]) -> tuple[list[bytes], list[int]]:
        """The chain keys of the full blocks of `ids`, and the cached blocks its start matches.
        The last token is always prefilled (its logits give the first sample), so the block
        holding it is never taken from the cache."""
        if not self.pool.enable_caching:
            return [], []
        bs = self.block_size
        keys = chain_hashes(ids, bs, len(ids) // bs)
        hits = []
        for key in keys[:(len(ids) - 1) // bs]:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return keys, hits

    def _chunk(self, req: Request, budget: int, new_rows: list[NewRow],
               entries: list[tuple[int, int, int]], chunks: list[PrefillChunk],
               requests: list[Request]) -> int:
        """Schedules the request's next chunk, at most `budget` tokens. Its last chunk gives it
        a row (and, unless the step is mixed, a decode token this very step). Returns the
        budget it took."""
        ids, start = req.prefill_ids, req.num_computed
        n = min(len(ids) - start, budget)
        last = start + n == len(ids)
        row = None
        if last:
            self.prefilling.remove(req)
            row = self._add_row(req, new_rows, entries)
        else:
            self.stats.prefill_chunks += 1
        chunks.append(PrefillChunk(
            token_ids=ids[start:start + n], start=start, blocks=req.blocks, row=row,
            step=len(req.output),
            resume_token=req.output[-1] if last and req.output else None,
            logprob_targets=_logprob_targets(req, start, n)))
        requests.append(req)
        req.num_computed += n
        # The blocks this chunk fills are cached from now on: any later reader runs after the
        # chunk on the same stream.
        for j in range(start // self.block_size, min(req.num_computed // self.block_size,
                                                      len(req.block_keys))):
            self.pool.register(req.blocks[j], req.block_keys[j])
        return n + int(last and not self.mixed)

    def _add_row(self, req: Request, new_rows: list[NewRow],
                 entries: list[tuple[int, int, int]]) -> int:
        req.status = Status.RUNNING
        row = len(self.running)
        self.running.append(req)
        p = req.params
        new_rows.append(NewRow(row=row, temperature=p.temperature,
                               top_k=req.top_k, top_p=p.top_p,
                               seed=req.seed, min_tokens=p.min_tokens,
                               stop_ids=sorted(req.stop_ids),
                               penalties=_row_penalties(req) if p.uses_penalties else None))
        entries += [(row, c, b) for c, b in enumerate(req.blocks)]
        return row

    def _evict(self, req: Request) -> None:
        """Frees a paused or prefilling request's KV and requeues it to recompute prompt +
        output so far."""
        self.stats.evictions += 1
        self.release(req)
        req.status = Status.WAITING
        self.add(req)

    # -- releasing ----------------------------------------------------------------------------

    def release(self, req: Request) -> None:
        """Gives back a request's blocks, after the last step that may write them retired."""
        blocks, req.blocks = req.blocks, []
        if not blocks:
            return
        if req.in_flight:
            self.deferred.append((req.last_launched_step, blocks))
        else:
            self.pool.free(blocks)

    def retire(self, step_id: int) -> None:
        """Called once the results of `step_id` are reconciled."""
        still = []
        for sid, blocks in self.deferred:
            if sid <= step_id:
                self.pool.free(blocks)
            else:
                still.append((sid, blocks))
        self.deferred = still


def _logprob_targets(req: Request, start: int, n: int) -> list[int] | None:
    """The prompt tokens whose logprobs a chunk of `n` tokens from `start` gives: those after
    each of its positions, within the prompt. A recompute after the first token has them."""
    if req.params.prompt_logprobs is None or req.output or start + 1 >= len(req.prompt):
        return None
    return req.prompt[start + 1:min(start + n + 1, len(req.prompt))]


def _row_penalties(req: Request) -> RowPenalties:
    p = req.params
    return RowPenalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
                        p.logit_bias or {}, req.prompt, req.output)
