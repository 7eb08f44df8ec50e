"""What the server itself needs to know, apart from the Engine's own options."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeConfig:
    model: str  # what the Engine is built from: a directory, a GGUF file or a preset name
    served_model_name: str  # the one name /v1 requests must use in their `model` field
    engine_options: dict = field(default_factory=dict)  # passed to Engine(model, **options)
    api_key: str | None = None  # when set, every /v1 route wants `Authorization: Bearer <key>`
    # Requests admitted but not yet running (queued in the engine or on their way to it) beyond
    # which a new request is refused with 503 instead of waiting without bound.
    max_queue: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {self.max_queue!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
