"""The all-reduce of a decode step's small partial sums through torch's symmetric memory.

An NCCL all-reduce of a few kilobytes costs about as much as one of a megabyte: the time goes to
its protocol, not to moving data, and a llama-8b step at tensor_parallel_size 2 makes 64 of
them. torch's one-shot all-reduce instead has every rank copy its partial sum into a buffer that
all ranks mapped at start-up (over NVLink), meet at a barrier of flags in that memory, and read
all the ranks' copies to sum them: one kernel, no host work, and it can be captured in a CUDA
graph like any other. It reads every peer's whole buffer, so it suits small messages; larger
ones (prefill chunks) keep NCCL.

No NVLink multicast is involved (the multimem variants are never called).

GRAPHEXEC_ALL_REDUCE picks the implementation: "nccl" (the default) or "symm_mem". On two H100s
(llama-8b, 2026-11-25, docs/benchmarks.md "Tensor parallelism") the one-shot kernel took about
9 us an all-reduce at batch 1 (the wait for the other rank included) and the step was no faster
than with NCCL (3.60 against 3.54 ms; 5.01 against 4.94 ms at batch 64), so NCCL stays the
default.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

# One-shot reads (size - 1) whole peer buffers: cheap for two ranks at any decode batch, worse
# than NCCL's ring for large messages on many ranks. Above this size a message goes to NCCL.
# Measured at size 2 only (docs/benchmarks.md, "Tensor parallelism"); the split for more ranks
# is a guess.
ONE_SHOT_BYTES_AT_SIZE_2 = 4 << 20


def choice() -> str:
    value = os.environ.get("GRAPHEXEC_ALL_REDUCE", "nccl")
    if value not in ("symm_mem", "nccl"):
        raise ValueError(f"GRAPHEXEC_ALL_REDUCE={value!r}: expected 'symm_mem' or 'nccl'")
    return value


class SymmetricAllReduce:
    """One rank's mapped buffer and the one-shot op over it. Every rank must construct it at the
    same point (the rendezvous that maps the buffers is a collective)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, size: int):
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = 2 * ONE_SHOT_BYTES_AT_SIZE_2 // size
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # a no-op or absent in newer torch; required in older
            enable(self.group_name)
        self.buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() <= self.max_bytes

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's t, in a new tensor (t is only read). The copy into the mapped
        buffer happens inside the same kernel."""
        staged = self.buffer.view(t.dtype)[: t.numel()].view_as(t)
        out = torch.empty_like(t)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, t, "sum", self.group_name, out)
        return out


def make_reducer(group: dist.ProcessGroup, device: torch.device,
                 size: int) -> SymmetricAllReduce | None:
    """The symmetric-memory reducer on CUDA when GRAPHEXEC_ALL_REDUCE asks for it; else None
    (NCCL, or gloo on the CPU)."""
    if device.type != "cuda" or choice() != "symm_mem":
        return None
    return SymmetricAllReduce(group, device, size)
