"""What every route shares: the config, the engine loop, the metrics, and admission."""
from __future__ import annotations

from dataclasses import dataclass

from .config import ServeConfig
from .engine_loop import EngineLoop
from .errors import APIError, invalid, unavailable
from .metrics import ServerMetrics
from .model_info import ModelInfo


@dataclass
class ServerState:
    config: ServeConfig
    loop: EngineLoop
    metrics: ServerMetrics
    draining: bool = False  # set when shutdown begins: no new requests from then on

    @property
    def ready(self) -> bool:
        return self.loop.serving and not self.draining

    def model_info(self) -> ModelInfo:
        """For validation; 503 while the engine is still being built (or is gone)."""
        if not self.ready:
            self._refuse_unavailable()
        return self.loop.info

    def check_model(self, name: str) -> None:
        if name != self.config.served_model_name:
            # 404, as OpenAI answers for a model it does not have
            raise APIError(f"model: the model {name!r} does not exist; this server serves "
                           f"{self.config.served_model_name!r}", status=404, param="model",
                           code="model_not_found")

    def check_fits_queue(self, num_prompts: int, n: int) -> None:
        """A request larger than the whole queue would get a 503 forever: that is the client's
        error (400), naming n if n alone is too many, else the prompt batch."""
        limit = self.config.max_queue
        if num_prompts * n <= limit:
            return
        param = "n" if n > limit else "prompt"
        raise invalid(f"{param}: {num_prompts} prompt(s) x n={n} is {num_prompts * n} "
                      f"requests, more than this server ever queues at once (max_queue="
                      f"{limit}); split it into requests of at most {limit}", param,
                      code="too_many_requests_in_batch")

    def admit(self, n: int) -> None:
        """Raises 503 rather than letting the queue grow without bound."""
        if not self.ready:
            self._refuse_unavailable()
        waiting = self.loop.num_waiting()
        if waiting + n > self.config.max_queue:
            self.metrics.refused.labels("queue_full").inc()
            raise unavailable(f"the server is at capacity ({waiting} requests waiting, "
                              f"max_queue={self.config.max_queue}); retry later", "queue_full")

    def _refuse_unavailable(self):
        self.metrics.refused.labels("unavailable").inc()
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        raise unavailable(f"the engine is {self.loop.phase.value}", "not_ready")
