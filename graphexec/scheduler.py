"""Scheduler: who is in the batch for the next step, and which KV blocks they own.

Policy, no tensors. Each step it (1) drops rows that ended or surely end within the steps in
flight, (2) makes sure every running row owns the block its next write lands in (pausing, then
evicting, under KV pressure: see _make_room), (3) resumes paused rows, and (4) admits waiting
requests in arrival order while rows and blocks allow. The result is a StepDelta for the device
plus the prefills to run.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .capture.state import NewRow, StepDelta, Variant
from .block_pool import BlockPool
from .request import Request, Status
from .runner import PrefillRow


@dataclass
class Plan:
    step_id: int
    delta: StepDelta | None  # None: the batch is unchanged since the last step
    prefills: list[PrefillRow]
    prefill_requests: list[Request]
    rows: list[Request]  # row order at launch: results are matched to requests by it
    bucket: int
    variant: Variant

    @property
    def empty(self) -> bool:
        return not self.rows


@dataclass
class SchedulerStats:
    evictions: int = 0
    pauses: int = 0
    resumed: int = 0
    admitted: int = 0
    deferred_releases: int = 0


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_batch: int,
                 buckets: list[int], max_prefill_tokens: int, spec_tokens: int = 0):
        self.pool = pool
        self.spec_tokens = spec_tokens  # K draft positions written past each row's input
        self.block_size = block_size
        self.max_batch = max_batch
        self.buckets = buckets
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # row order of the DecodeState
        self.paused: list[Request] = []  # out of the batch, KV kept; sorted by arrival
        # (step id, blocks): freed once that step's results are reconciled, because until then
        # the device may still write them.
        self.deferred: list[tuple[int, list[int]]] = []
        self.stats = SchedulerStats()

    # -- queue --------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.arrival)

    def remove_waiting(self, req: Request) -> None:
        """Takes a waiting or paused request out of its queue (abort)."""
        if req in self.paused:
            self.paused.remove(req)
        else:
            self.waiting.remove(req)

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
        prefills: list[PrefillRow] = []
        admitted: list[Request] = []
        if not self.paused:  # paused rows hold KV already: they go first
            self._admit(new_rows, entries, prefills, admitted)
        n_rows = len(self.running)
        delta = None
        if compacted or new_rows or entries:
            delta = StepDelta(num_rows=n_rows, row_map=row_map if compacted else None,
                              new_rows=new_rows, block_entries=entries)
        bucket = next((b for b in self.buckets if b >= n_rows), self.max_batch)
        self.stats.resumed += resumed
        return Plan(step_id=step_id, delta=delta, prefills=prefills, prefill_requests=admitted,
                    rows=list(self.running), bucket=bucket,
                    variant=self._variant())

    def _variant(self) -> Variant:
        logprobs = any(r.params.logprobs is not None for r in self.running)
        if self.spec_tokens and all(r.params.temperature == 0 for r in self.running):
            return Variant(logprobs, filters=False, sampled=False)  # filters: greedy ignores them
        return Variant(logprobs, filters=any(r.top_k > 0 or r.params.top_p < 1
                                             for r in self.running))

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
            if len(self.running) >= self.max_batch:
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

    def _admit(self, new_rows, entries, prefills: list[PrefillRow],
               admitted: list[Request]) -> None:
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if req.finished:
                self.waiting.pop(0)
                continue
            if req.in_flight:  # evicted while a step was out: its last tokens are not known yet
                break
            n = req.num_tokens
            # the prompt, the first token, and what the first decode step may write after it
            need = self.blocks_for(min(n + 1 + self.spec_tokens, req.max_len))
            if not self.pool.can_allocate(need) or (admitted and n > budget):
                break
            self.waiting.pop(0)
            budget -= n
            req.blocks = self.pool.allocate(need)
            row = self._add_row(req, new_rows, entries)
            admitted.append(req)
            resumed = bool(req.output)  # evicted: rebuild its KV, decode on from its last token
            prefills.append(PrefillRow(row=row, token_ids=req.prompt + req.output[:-1],
                                       blocks=req.blocks, step=len(req.output),
                                       resume_token=req.output[-1] if resumed else None))
        self.stats.admitted += len(admitted)

    def _add_row(self, req: Request, new_rows: list[NewRow],
                 entries: list[tuple[int, int, int]]) -> int:
        req.status = Status.RUNNING
        row = len(self.running)
        self.running.append(req)
        p = req.params
        new_rows.append(NewRow(row=row, temperature=p.temperature,
                               top_k=req.top_k, top_p=p.top_p,
                               seed=req.seed, min_tokens=p.min_tokens,
                               stop_ids=sorted(req.stop_ids)))
        entries += [(row, c, b) for c, b in enumerate(req.blocks)]
        return row

    def _evict(self, req: Request) -> None:
        """Frees a running request's KV and requeues it to recompute prompt + output so far."""
        self.stats.evictions += 1
        req.num_evictions += 1
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
            self.stats.deferred_releases += 1
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

    def blocks_in_flight(self) -> int:
        return sum(len(b) for _, b in self.deferred)
