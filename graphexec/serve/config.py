"""What the server itself needs to know, apart from the Engine's own options."""
from __future__ import annotations

from dataclasses import dataclass, field

from .limits import DEFAULT_MAX_REQUEST_BYTES
from .routing import ROUTINGS
from .tool_parsers import PARSERS


@dataclass
class ServeConfig:
    model: str  # what the Engine is built from: a directory, a GGUF file or a preset name
    served_model_name: str  # the one name /v1 requests must use in their `model` field
    engine_options: dict = field(default_factory=dict)  # passed to Engine(model, **options)
    api_key: str | None = None  # when set, every /v1 route wants `Authorization: Bearer <key>`
    # Requests admitted but not yet running (queued in the engine or on their way to it) beyond
    # which a new request is refused with 503 instead of waiting without bound.
    max_queue: int = 256
    # Bodies above this are refused with 413 before they are read (limits.py).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # Data-parallel replicas: "prefix" sends a request where its leading KV blocks are likely
    # cached (unless that replica is much busier), "load" to the least busy (routing.py).
    routing: str = "prefix"
    # The model's tool-call format (tool_parsers.py), read out of its output when a request's
    # tool_choice is "auto"; None refuses "auto".
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue must be a positive integer, got {self.max_queue!r}")
        if not isinstance(self.max_request_bytes, int) or self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be a positive integer, got "
                             f"{self.max_request_bytes!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
