"""A deployment manifest: what tools/capture.py measured, read back by LLM(..., manifest=...)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field


@dataclass
class BucketEntry:
    bucket: int
    capture_ms: float
    graph_mib: float
    parity_error: float


@dataclass
class Manifest:
    model: str
    dtype: str
    gpu: str
    versions: dict[str, str]
    max_batch: int
    max_model_len: int
    block_size: int
    buckets: list[BucketEntry] = field(default_factory=list)
    triton_cache_dir: str | None = None
    kernels: str = "cublas"  # the kernel set captured: see kernel_set()

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Manifest":
        if not os.path.isfile(path):
            raise ValueError(f"manifest={path!r}: no such file")
        with open(path) as f:
            raw = json.load(f)
        try:
            raw["buckets"] = [BucketEntry(**b) for b in raw["buckets"]]
            return cls(**raw)
        except (KeyError, TypeError) as e:
            raise ValueError(f"manifest={path!r} is not a graphexec manifest: {e}") from e

    def buckets_within(self, graph_memory_mib: float | None) -> list[int]:
        """The buckets to capture: all of them, or the smallest ones whose graphs fit the budget
        (the largest bucket's pool is shared, so memory is dominated by the largest kept)."""
        ordered = sorted(self.buckets, key=lambda b: b.bucket)
        if graph_memory_mib is None:
            return [b.bucket for b in ordered]
        kept, used = [], 0.0
        for b in ordered:
            if used + b.graph_mib > graph_memory_mib:
                break
            kept.append(b.bucket)
            used += b.graph_mib
        if not kept:
            raise ValueError(f"graph_memory_mib={graph_memory_mib}: not even bucket "
                             f"{ordered[0].bucket} fits ({ordered[0].graph_mib:.1f} MiB)")
        return kept


def kernel_set(projections: str, batch_invariant: bool) -> str:
    """The engine's kernel set in one word: graphs (and their memory) differ between sets."""
    return "invariant" if batch_invariant else projections


def current_versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        out["graphexec"] = version("graphexec")
    except PackageNotFoundError:
        out["graphexec"] = "source"
    return out
