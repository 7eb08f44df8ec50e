"""Prometheus metrics (prometheus_client), every name starting with graphexec_.

Two sources: the engine's own counters (EngineSnapshot, sent by the engine process after
each iteration and read at scrape time by a custom collector, so the engine never touches a
metric), and per-request timings observed on the event loop as outputs are handed
over (time to first token and inter-token latency as the server hands them to the connection).
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine_loop import EngineSnapshot
from .events import Delta, Event, Sink

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], waiting: Callable[[], int]):
        self._snapshot = snapshot
        self._waiting = waiting

    def collect(self):
        s = self._snapshot()
        gauges = (("requests_running", "Requests decoding in the engine's batch.", s.running),
                  ("requests_waiting", "Requests accepted but not running yet (queued, paused, "
                   "or on their way to the engine).", self._waiting()),
                  ("requests_paused", "Requests out of the batch under KV pressure, KV kept.",
                   s.paused),
                  ("kv_blocks_used", "KV cache blocks in use.", s.kv_used),
                  ("kv_blocks_total", "KV cache blocks in the pool.", s.kv_total),
                  ("kv_blocks_cached", "KV blocks holding a cached prompt prefix, in use or "
                   "free (prefix caching).", s.cached_blocks))
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"graphexec_{name}", doc)
            g.add_metric([], value)
            yield g
        counters = (("engine_steps", "Decode iterations launched.", s.steps),
                    ("engine_pauses", "Requests paused under KV pressure.", s.pauses),
                    ("engine_evictions", "Requests evicted (KV dropped, recomputed later).",
                     s.evictions),
                    ("engine_chain_breaks", "Launches that waited for the device.",
                     s.chain_breaks),
                    ("engine_batch_rows", "Rows over all launched steps (over engine_steps: "
                     "the mean batch).", s.batch_rows),
                    ("prefix_query_tokens", "Prompt tokens admitted, recomputes included.",
                     s.prefix_query_tokens),
                    ("prefix_hit_tokens", "Of those, tokens whose KV a cached block held.",
                     s.prefix_hit_tokens))
        for name, doc, value in counters:
            c = CounterMetricFamily(f"graphexec_{name}", doc)
            c.add_metric([], value)
            yield c


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], waiting: Callable[[], int]):
        # A registry of its own: two servers in one process (tests) never share series.
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("graphexec_time_to_first_token_seconds",
                              "From the request's arrival to its first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("graphexec_inter_token_latency_seconds",
                             "Time between a request's outputs, per token they carry.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("graphexec_e2e_request_latency_seconds",
                             "From the request's arrival to its last token.",
                             buckets=_TTFT_BUCKETS, registry=r)
        self.generation_tokens = Counter("graphexec_generation_tokens",
                                         "Tokens generated (handed to requests).", registry=r)
        self.prompt_tokens = Counter("graphexec_prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.finished = Counter("graphexec_requests_finished", "Requests ended, by reason.",
                                ["finish_reason"], registry=r)
        self.refused = Counter("graphexec_requests_refused",
                               "Requests answered with an error before running, by reason.",
                               ["reason"], registry=r)
        r.register(_EngineCollector(snapshot, waiting))

    def observe(self, sink: Sink, ev: Event, now: float) -> None:
        """The engine loop's observer: runs on the event loop as each event is handed over."""
        if not isinstance(ev, Delta):
            return
        n = len(ev.token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = sink.last_token_at.get(ev.index)
            if last is None:
                self.ttft.observe(now - sink.arrival)
            else:
                self.itl.observe((now - last) / n)
            sink.last_token_at[ev.index] = now
        if ev.finish_reason is not None:
            self.finished.labels(ev.finish_reason).inc()
            self.e2e.observe(now - sink.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
