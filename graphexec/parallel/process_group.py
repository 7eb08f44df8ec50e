"""The torch.distributed set-up every tensor-parallel rank runs: NCCL between CUDA devices, gloo
on the CPU, over a TCP store that rank 0 hosts: on this machine, where every rank is one of its
processes, or at dist_init_addr for ranks on several hosts (nodes.py)."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..model.shard import Shard
from . import symmetric
from .nodes import NodeLayout

# Rendezvous and start-up collectives wait for the slowest rank to load its shard from disk
# and capture its graphs.
START_TIMEOUT = timedelta(minutes=10)
# A collective inside a step: a rank that has not joined by then is hung. (A rank that died is
# noticed sooner: its sockets close, and rank 0 checks the workers' exit codes every step.)
STEP_TIMEOUT = timedelta(seconds=60)
# Where rank 0 leaves its choice of all-reduce for the other ranks (parallel/symmetric.py).
_REDUCER_KEY = "graphexec/all_reduce"


def host_store(layout: NodeLayout) -> dist.TCPStore:
    """Rank 0's store: at layout's port, or (one node) on a port the OS picks (store.port), so
    no port is guessed."""
    return dist.TCPStore(layout.host, layout.port, layout.size, is_master=True,
                         timeout=START_TIMEOUT, wait_for_workers=False)


def connect_store(layout: NodeLayout) -> dist.TCPStore:
    return dist.TCPStore(layout.host, layout.port, layout.size, is_master=False,
                         timeout=START_TIMEOUT)


def rank_device(device: torch.device, local_index: int) -> torch.device:
    """A rank runs on the CUDA device local_index places from `device` on (its place among its
    node's ranks); every rank of a CPU run on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_index)


def join_process_group(rank: int, size: int, device: torch.device,
                       store: dist.TCPStore, one_host: bool = True) -> Shard:
    """Joins the default group (start-up collectives) and makes the group the forward's
    all-reduces run on, with the shorter step timeout. Every rank must call it. Ranks on
    several hosts use the backend's own all-reduce: the Triton one maps every rank's memory."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if rank == 0:
        store.set(_REDUCER_KEY, symmetric.pick(device) if one_host else "nccl")
    reducer_kind = store.get(_REDUCER_KEY).decode()
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=START_TIMEOUT)
    group = dist.new_group(timeout=STEP_TIMEOUT)
    # A group's communicator is made at its first collective: here, before the weights fill
    # the device (NCCL's buffers did not fit beside llama-70b's half), not at the first use.
    for g in (None, group):
        dist.all_reduce(torch.zeros(1, device=device), group=g)
    return Shard(rank, size, group, symmetric.make_reducer(reducer_kind, group, device, size))


def leave_process_group(abort: bool = False, timeout_s: float | None = None) -> bool:
    """Destroys the groups. Every rank must call it, at about the same time: shutting an NCCL
    communicator down waits for its peers. A rank whose peer died aborts instead, since the
    peer will never come. With timeout_s, the shutdown runs in a daemon thread and False means
    it had not finished by then (the group then still exists in this process)."""
    if not dist.is_initialized():
        return True
    end = dist.destroy_process_group
    if abort:
        end = getattr(dist.distributed_c10d, "_abort_process_group", end)
    if timeout_s is None:
        end()
        return True
    thread = threading.Thread(target=end, name="graphexec-leave-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()
