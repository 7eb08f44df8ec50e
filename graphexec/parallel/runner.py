"""TensorParallelRunner: rank 0's ModelRunner. Each launch goes to the workers first (a pipe
write), then onto rank 0's own device; the ranks meet only in the all-reduces inside the
forward. Everything else (results, graphs, staging) is the plain runner's."""
from __future__ import annotations

from ..plan import PrefillChunk, StepDelta, Variant
from ..runner import Launched, ModelRunner, StepTokens
from .workers import WorkerGroup


class TensorParallelRunner(ModelRunner):
    def __init__(self, *args, workers: WorkerGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.workers = workers

    def launch(self, delta: StepDelta | None, prefills: list[PrefillChunk], bucket: int,
               variant: Variant) -> Launched:
        self.workers.send("launch", delta, prefills, bucket, variant)
        with self.workers.watch():
            if delta is not None:
                # Applied here so that the base launch, given None, does not call
                # self.apply_delta: that would send the delta to the workers a second time.
                super().apply_delta(delta)
            return super().launch(None, prefills, bucket, variant)

    def apply_delta(self, delta: StepDelta) -> None:
        self.workers.send("delta", delta)
        with self.workers.watch():
            super().apply_delta(delta)

    def fetch(self, launched: Launched, top_n: tuple[list, list] | None = None) -> StepTokens:
        event = self._d2h[launched.slot].event
        if event is not None:  # CUDA: wait here, where a dead worker can be noticed
            self.wait_seconds += self.workers.wait_for(event)
        return super().fetch(launched, top_n)
