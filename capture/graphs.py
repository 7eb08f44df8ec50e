"""One CUDA graph per (batch bucket, variant), and one per (prefill token bucket, logprobs on/off,
penalties on/off, grammar masks on/off), all in one memory pool.

Each decode graph is the whole decode iteration (forward, sample, advance) over DecodeState's
static buffers, so replaying it needs no host input: the host only changes the buffers (through a
StepDelta) when the batch changes. Each prefill-bucket graph is what the runner runs for a step
with prompt chunks (ModelRunner.padded_mixed_step: capture/mixed.py's mixed_step, without decode
rows for a speculative runner) over a static metadata buffer that
the host fills with one H2D copy before the replay.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..plan import Variant
from .iteration import SampleOut


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
    # (token bucket, logprobs, penalties, grammar) -> (graph, its sample outputs)
    prefill: dict[tuple[int, bool, bool, bool], tuple[torch.cuda.CUDAGraph, SampleOut]] = field(
        default_factory=dict)

    def has(self, bucket: int, variant: Variant) -> bool:
        return (bucket, variant) in self.graphs

    def replay(self, bucket: int, variant: Variant) -> None:
        self.graphs[(bucket, variant)].replay()

    def replay_prefill(self, tokens: int, with_logprobs: bool, penalties: bool = False,
                       grammar: bool = False) -> SampleOut:
        graph, out = self.prefill[(tokens, with_logprobs, penalties, grammar)]
        graph.replay()
        return out

    @classmethod
    def capture(cls, runner, buckets: list[int], variants: list[Variant],
                token_buckets: list[int] = (), progress: bool = True) -> "GraphSet":
        """Captures every prefill and decode bucket, largest first so the smaller ones reuse
        its pool memory. Must run while no request is in the batch: with num_rows == 0 every
        row is inert, so warm-up and capture write only the scratch block, the inert row and
        the output buffers."""
        if runner.num_rows != 0:
            raise RuntimeError("graphs must be captured on an empty batch")
        out = cls(pool=torch.cuda.graph_pool_handle())
        with_lp = sorted({v.logprobs for v in variants})
        # the (penalties, grammar) pairs the decode variants hold, for the mixed steps too
        pen_grammar = sorted({(v.penalties, v.grammar) for v in variants})
        todo = [(("prefill", t, lp, pen, g),
                 lambda t=t, lp=lp, pen=pen, g=g: runner.padded_mixed_step(t, lp, penalties=pen,
                                                                           grammar=g))
                for t in sorted(token_buckets, reverse=True) for lp in with_lp
                for pen, g in pen_grammar]
        todo += [((b, v), lambda b=b, v=v: runner.iterate(b, v))
                 for b in sorted(buckets, reverse=True) for v in variants]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="capturing CUDA graphs", unit="graph", leave=False)
        # Warm up once per shape on a side stream: lazy inits and Triton compiles must not
        # happen under capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _, run in todo:
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # engine start, before capture; never on the decode path
        # Objects of an earlier engine collected mid-capture free pinned memory and events,
        # which a capturing stream does not permit: collect now, not during capture.
        gc.collect()
        gc.disable()
        try:
            out._capture_all(todo, bar)
        finally:
            gc.enable()
        runner.results.reset()  # the warm-ups published: the first launch takes slot 0 again
        if bar is not None:
            bar.close()
        return out

    def _capture_all(self, todo, bar) -> None:
        for key, run in todo:
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                result = run()
            torch.cuda.synchronize()  # capture time only (engine start): per-bucket ms is exact
            ms = (time.perf_counter() - t0) * 1e3
            mib = (torch.cuda.memory_reserved() - before) / 2**20
            if key[0] == "prefill":
                self.prefill[key[1:]] = (g, result)
            else:
                self.graphs[key] = g
                self.reports.append(BucketReport(key[0], key[1], ms, mib))
            if bar is not None:
                bar.update(1)
