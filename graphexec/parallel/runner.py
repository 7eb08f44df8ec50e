"""TensorParallelRunner: rank 0's ModelRunner. Each launch goes to the workers first (a pipe
write), then onto rank 0's own device; the ranks meet only in the all-reduces inside the
forward. Everything else (results, graphs, staging) is the plain runner's."""
from __future__ import annotations

from contextlib import contextmanager

from ..runner import ModelRunner
from .workers import WorkerGroup


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, workers: WorkerGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers = workers

    @contextmanager
    def _mirrored(self, kind: str, *args):
        """The workers make the same call (graphexec/parallel/worker.py) while rank 0 makes
        it; a worker that dies meanwhile is reported, not waited for."""
        self.workers.send(kind, *args)
        with self.workers.watch():
            yield

    def _wait(self, event) -> float:
        # CUDA: wait here, where a dead worker can be noticed
        return self.workers.wait_for(event)
