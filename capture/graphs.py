"""One CUDA graph per (batch bucket, logprobs on/off), all in one memory pool.

Each graph is the whole decode iteration (forward, sample, advance) over DecodeState's static
buffers, so replaying it needs no host input: the host only changes the buffers (through a
StepDelta) when the batch changes.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .state import Variant


@dataclass
class BucketReport:
    bucket: int
    variant: Variant
    capture_ms: float
    graph_mib: float


@dataclass
class GraphSet:
    graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = field(default_factory=dict)
    reports: list[BucketReport] = field(default_factory=list)
    pool: object = None
    # called after every replay: the runner's ResultMailbox counts the iterations that ran
    after_replay: Callable[[], None] | None = None

    def has(self, bucket: int, variant: Variant) -> bool:
        return (bucket, variant) in self.graphs

    def replay(self, bucket: int, variant: Variant) -> None:
        self.graphs[(bucket, variant)].replay()
        if self.after_replay is not None:
            self.after_replay()

    @classmethod
    def capture(cls, runner, buckets: list[int], variants: list[Variant],
                progress: bool = True) -> "GraphSet":
        """Captures every bucket, largest first so the smaller ones reuse its pool memory.
        Must run while no request is in the batch: with num_rows == 0 every row is inert, so
        warm-up and capture write only the scratch block and the output buffers."""
        if runner.num_rows != 0:
            raise RuntimeError("graphs must be captured on an empty batch")
        mailbox = getattr(runner, "mailbox", None)
        out = cls(pool=torch.cuda.graph_pool_handle(),
                  after_replay=mailbox.ran if mailbox is not None else None)
        todo = [(b, v) for b in sorted(buckets, reverse=True) for v in variants]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="capturing CUDA graphs", unit="graph", leave=False)
        run = runner.iterate
        # Warm up once per shape on a side stream: lazy inits and Triton compiles must not
        # happen under capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b, lp in todo:
                run(b, lp)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # engine start, before capture; never on the decode path
        # Objects of an earlier engine collected mid-capture free pinned memory and events,
        # which a capturing stream does not permit: collect now, not during capture.
        gc.collect()
        gc.disable()
        try:
            out._capture_all(todo, run, bar)
        finally:
            gc.enable()
        if bar is not None:
            bar.close()
        return out

    def _capture_all(self, todo, run, bar) -> None:
        for b, lp in todo:
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                run(b, lp)
            torch.cuda.synchronize()  # capture time only (engine start): per-bucket ms is exact
            self.graphs[(b, lp)] = g
            self.reports.append(BucketReport(b, lp, (time.perf_counter() - t0) * 1e3,
                                             (torch.cuda.memory_reserved() - before) / 2**20))
            if bar is not None:
                bar.update(1)
