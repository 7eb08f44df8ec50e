"""The all-reduce of a decode step's small partial sums through symmetric memory.

An NCCL all-reduce of a few kilobytes costs about as much as one of a megabyte: the time goes to
its protocol, not to moving data, and a llama-8b step at tensor_parallel_size 2 makes 64 of
them. Symmetric memory is a buffer every rank mapped at start-up (over NVLink), so a kernel can
write into its peers' buffers directly: one kernel, no host work, captured in a CUDA graph like
any other. A one-shot kernel sends its whole message to every peer, so it suits small messages;
larger ones (prefill chunks) keep NCCL. No NVLink multicast is involved.

GRAPHEXEC_ALL_REDUCE picks the implementation:
  "triton" (the default): ours (kernels/all_reduce_triton.py), launched as a programmatic
      dependent, so the next projection fetches its first weight tiles during the exchange, and
      pushing each rank's partial to its peers with the flag inside every word; it also does
      the residual add and RMSNorm after it, o and down on Triton send their partial sums from
      their epilogue, and a rank's LM head at 33-64 rows lands its logits in its peers' memory
      (docs/architecture.md, "Tensor parallelism");
  "nccl": the group's NCCL all-reduce.

One mapping a process: in a process that has mapped a symmetric buffer once, a second
rendezvous (a second tensor-parallel engine whose workers are new processes) never completed
on two H200s, with group names made unique too: torch's CUDA symmetric memory appears to number
the store keys of its rendezvous with one counter per process (read in its source, not yet
confirmed on a device), so rank 0 and a new worker wait on different keys. Rank 0 therefore
asks for the Triton kind only the first time (pick); later engines of the process use NCCL,
and every rank follows rank 0's pick.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ..kernels.tuning import CollectiveTuning, tuning_for

CHOICES = ("nccl", "triton")
DEFAULT = "triton"
# Whether this process has mapped a symmetric buffer (module docstring).
_mapped_once = False


def choice() -> str:
    value = os.environ.get("GRAPHEXEC_ALL_REDUCE", DEFAULT)
    if value not in CHOICES:
        raise ValueError(f"GRAPHEXEC_ALL_REDUCE={value!r}: expected one of {CHOICES}")
    return value


def check(size: int) -> None:
    """GRAPHEXEC_ALL_REDUCE valid for tensor_parallel_size=size, or a ValueError: checked when
    the engine's config is built, before any worker starts."""
    kind = choice()
    if kind == "triton":
        from ..kernels.all_reduce_triton import MAX_WORLD

        if size > MAX_WORLD:
            raise ValueError(f"GRAPHEXEC_ALL_REDUCE=triton serves at most {MAX_WORLD} ranks, "
                             f"got tensor_parallel_size={size}")


def _mapped(group: dist.ProcessGroup, device: torch.device, nbytes: int):
    """A buffer of nbytes that every rank of group maps, and its rendezvous handle. Every rank
    must call it at the same point (the rendezvous is a collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # deprecated from torch 2.11 (the group's store is used directly)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer, symm_mem.rendezvous(buffer, group.group_name)


class TritonAllReduce:
    """kernels/all_reduce_triton.py over one rank's mapped area ("triton")."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, size: int,
                 t: CollectiveTuning):
        from ..kernels import all_reduce_triton

        check(size)
        self.t = t
        self._kernel = all_reduce_triton
        from ..kernels.gather_triton import Landing

        # above this message size (at two ranks; half at four, ...) a message goes to NCCL
        max_words = all_reduce_triton.PeerAreas.box_words(2 * t.one_shot_bytes_at_size_2 // size)
        area = all_reduce_triton.PeerAreas.area_bytes(size, max_words)
        # one mapping: the all-reduce's area, then the gather's landing zone, then its counter
        # (a second rendezvous in a process is what the module docstring warns of)
        zone = size * t.gather_box_bytes
        self.buffer, handle = _mapped(group, device, area + zone + 64)
        bases = [int(p) for p in handle.buffer_ptrs]
        ptrs = lambda offset: torch.tensor([b + offset for b in bases], dtype=torch.int64,
                                           device=device)
        rank = dist.get_rank(group)
        self.areas = all_reduce_triton.PeerAreas(rank=rank, world=size, area_ptrs=ptrs(0),
                                                 max_words=max_words)
        self._pushes = tuple(all_reduce_triton.Push(self.areas, slot) for slot in (0, 1))
        self.landing = Landing(
            rank=rank, world=size, landing_ptrs=ptrs(area), counter_ptrs=ptrs(area + zone),
            zone=self.buffer[area:area + zone],
            waited=torch.zeros(1, dtype=torch.int64, device=device), box_bytes=t.gather_box_bytes)
        # Every word "not arrived" on every rank before any rank pushes one.
        self.buffer.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        self._last_slot: int | None = None

    def fits(self, t: torch.Tensor) -> bool:
        return self._kernel.fits(self.areas, t)

    def gather(self):
        """Where a rank's LM head lands its logits in the peers' memory."""
        return self.landing

    def push(self, slot: int):
        """Where a projection sends its output as this rank's message of the all-reduce in
        slot."""
        return self._pushes[slot]

    def __call__(self, t: torch.Tensor, slot: int, pushed: bool = False) -> torch.Tensor:
        """The sum of every rank's t, in a new tensor. slot: 0 or 1, alternating between
        consecutive all-reduces (the model's o and down). pushed: t's projection has sent it
        (push)."""
        self._check_slot(slot)
        out = self._kernel.all_reduce(t, self.areas, slot, pushed=pushed, t=self.t)
        self._last_slot = slot
        return out

    def fits_norm(self, t: torch.Tensor, residual: torch.Tensor,
                  norm_weight: torch.Tensor) -> bool:
        return self._kernel.fits_norm(self.areas, t, residual, norm_weight)

    def add_rms_norm(self, t: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, slot: int, pushed: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum + residual), sum + residual), the sum of every rank's t: one kernel
        (all_reduce_triton.all_reduce_add_rms_norm); slot and pushed as __call__'s."""
        self._check_slot(slot)
        out = self._kernel.all_reduce_add_rms_norm(t, residual, norm_weight, eps, self.areas,
                                                   slot, pushed=pushed, t=self.t)
        self._last_slot = slot
        return out

    def _check_slot(self, slot: int) -> None:
        if slot == self._last_slot:
            # the kernel's race freedom rests on it (kernels/all_reduce_triton.py): a caller
            # that breaks it would hang or sum a box twice, so it fails here on the host
            raise RuntimeError(f"all-reduce slot {slot} twice in a row: the model's "
                               f"all-reduces must alternate slots 0 and 1")


def pick(device: torch.device) -> str:
    """Rank 0's choice for a new engine: GRAPHEXEC_ALL_REDUCE's kind on CUDA, NCCL (or gloo)
    where the Triton kind cannot run: on the CPU, or in a process that mapped a buffer
    before (module docstring)."""
    kind = choice()
    if device.type != "cuda" or (kind != "nccl" and _mapped_once):
        return "nccl"
    return kind


def make_reducer(kind: str, group: dist.ProcessGroup, device: torch.device,
                 size: int) -> TritonAllReduce | None:
    """The reducer of kind (pick's; every rank passes rank 0's), or None for the group's own
    all-reduce (NCCL, or gloo on the CPU)."""
    global _mapped_once
    if kind not in CHOICES:
        raise ValueError(f"all-reduce kind {kind!r}: expected one of {CHOICES}")
    if kind == "nccl":
        return None
    _mapped_once = True
    return TritonAllReduce(group, device, size, tuning_for(device).collective)
