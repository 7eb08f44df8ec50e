"""Data-parallel serving: N engine processes, each a whole model on its own GPUs, behind one
HTTP front end.

`Replicas` offers what the routes use of one EngineLoop (submit, abort, drain, stop, the
counters), so nothing above it knows how many engines there are. Each request goes where the
Router (routing.py) sends it. A replica whose process dies fails its own open requests (its
EngineLoop does that) and takes no new ones; the server goes on while any replica serves, and
exits only when none is left.
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine_loop import EngineLoop, EngineSnapshot, Phase
from .events import Rejected, Sink
from .routing import Router


class Replicas:
    def __init__(self, factories: list[Callable[[], object]], router: Router,
                 on_fatal: Callable[[], None] | None = None, log_level: str = "INFO"):
        self.router = router
        self.on_fatal = on_fatal
        self.loops = [EngineLoop(f, on_fatal=lambda r=r: self._failed(r), log_level=log_level)
                      for r, f in enumerate(factories)]
        self.routed: Counter = Counter()  # ("prefix" | "load", replica) -> requests
        self.hit_blocks = 0  # prompt blocks routed to a replica thought to hold them

    # -- what the routes and the app use, as of one EngineLoop -----------------------------------

    @property
    def observer(self):
        return self.loops[0].observer

    @observer.setter
    def observer(self, fn) -> None:
        for loop in self.loops:
            loop.observer = fn

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        for loop in self.loops:
            loop.start(aio_loop)

    @property
    def serving(self) -> bool:
        """Once every replica has started (none still loading), while any serves: requests
        that came while some were still capturing graphs would all land on the first one."""
        return (any(loop.serving for loop in self.loops)
                and not any(loop.phase is Phase.STARTING for loop in self.loops))

    @property
    def phase(self) -> Phase:
        phases = [loop.phase for loop in self.loops]
        if Phase.SERVING in phases:
            return Phase.SERVING
        if all(p is Phase.FAILED for p in phases):
            return Phase.FAILED
        for p in (Phase.STARTING, Phase.STOPPING, Phase.STOPPED):
            if p in phases:
                return p
        return Phase.FAILED

    @property
    def info(self):
        return next((loop.info for loop in self.loops if loop.info is not None), None)

    @property
    def error(self) -> BaseException | None:
        return next((loop.error for loop in self.loops if loop.error is not None), None)

    @property
    def snapshot(self) -> EngineSnapshot:
        snaps = [loop.snapshot for loop in self.loops]
        return EngineSnapshot(**{f.name: sum(getattr(s, f.name) for s in snaps)
                                 for f in fields(EngineSnapshot)})

    def num_waiting(self) -> int:
        return sum(loop.num_waiting() for loop in self.loops)

    def submit(self, request_id: str, prompt: list[int], params, sink: Sink, index: int) -> None:
        live = [loop.serving for loop in self.loops]
        if not any(live):
            sink.put(Rejected(index, "no engine replica is serving", 503))
            return
        info = self.info
        if info is not None:
            self.router.capacity, self.router.block_size = info.kv_blocks, info.block_size
        # Adds not yet answered count at once (num_waiting), so a burst spreads out before the
        # engines' next counters arrive.
        loads = [loop.snapshot.running + loop.num_waiting() for loop in self.loops]
        d = self.router.choose(prompt, loads, live)
        self.routed["prefix" if d.by_prefix else "load", d.replica] += 1
        self.hit_blocks += d.hit_blocks
        self.loops[d.replica].submit(request_id, prompt, params, sink, index)

    def abort(self, request_id: str) -> None:
        # Every replica is told: one that does not have the request ignores it, and nothing has
        # to remember where each finished request went.
        for loop in self.loops:
            if loop.serving:
                loop.abort(request_id)

    def drain(self, grace: float) -> None:
        for loop in self.loops:
            loop.drain(grace)

    def stop(self, timeout: float | None = None) -> None:
        """All replicas stop at once (each join waits on its own engine's abort and exit)."""
        threads = [threading.Thread(target=loop.stop, args=(timeout,)) for loop in self.loops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # -- faults and metrics ------------------------------------------------------------------

    def _failed(self, replica: int) -> None:
        """A replica that dies while serving leaves the others serving; one that never started
        (a bad device, no memory) ends the server, as a single engine's failure would, rather
        than leave it at a fraction of what was asked for."""
        self.router.forget(replica)  # on the event loop, as every other use of the router
        never_served = self.loops[replica].info is None
        gone = all(loop.phase is Phase.FAILED for loop in self.loops)
        if (gone or never_served) and self.on_fatal is not None:
            self.on_fatal()

    def health(self) -> list[dict]:
        return [{"replica": r, "status": loop.phase.value} for r, loop in enumerate(self.loops)]

    def collect(self):
        """Prometheus families: each replica's state, and the front end's routing."""
        per_replica = (("replica_up", "1 while the replica serves.",
                        lambda loop: float(loop.serving)),
                       ("replica_requests_running", "Requests decoding on the replica.",
                        lambda loop: loop.snapshot.running),
                       ("replica_requests_waiting", "Requests waiting for the replica.",
                        lambda loop: loop.num_waiting()),
                       ("replica_kv_blocks_used", "The replica's KV blocks in use.",
                        lambda loop: loop.snapshot.kv_used))
        for name, doc, value in per_replica:
            g = GaugeMetricFamily(f"graphexec_{name}", doc, labels=["replica"])
            for r, loop in enumerate(self.loops):
                g.add_metric([str(r)], value(loop))
            yield g
        c = CounterMetricFamily("graphexec_routed_requests", "Requests routed to each replica, "
                                "by what decided it (prefix or load).",
                                labels=["replica", "by"])
        for (by, r), n in sorted(self.routed.items()):
            c.add_metric([str(r), by], n)
        yield c
        c = CounterMetricFamily("graphexec_routed_prefix_blocks", "Prompt blocks routed to a "
                                "replica that was thought to hold them.")
        c.add_metric([], self.hit_blocks)
        yield c
