"""A tensor-parallel worker: one process per rank above 0. It builds its own rank (its shard of
the weights, its share of the KV cache, a ModelRunner with the engine's options and seed, the
same graphs) and then makes, step by step, the calls rank 0's runner makes, from the arguments
rank 0 sends. Its results are never read: sampling is replicated, so its device-resident next
inputs are rank 0's, and its result slots are simply reused."""
from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from ..config import EngineConfig
from .nodes import NodeLayout

# How often a worker with nothing to run checks that rank 0 is still alive.
PARENT_POLL_S = 1.0


def worker_main(cfg: EngineConfig, rank: int, layout: NodeLayout,
                conn: Connection | None) -> None:
    """The process's target. conn: the pipe from rank 0 on this host, or None on another node,
    where the worker connects to node 0's launch channel itself. On any failure the traceback
    goes to rank 0 before the exit."""
    from . import nodes, process_group

    joined, abort = False, True
    try:
        if conn is not None:
            conn.send(("hello",))
        cfg.device = process_group.rank_device(cfg.device, layout.local_index(rank))
        if cfg.device.type == "cuda":
            torch.cuda.set_device(cfg.device)
        store = process_group.connect_store(layout)
        if conn is None:
            conn = nodes.connect_channel(layout, store, rank)
        shard = process_group.join_process_group(rank, layout.size, cfg.device, store,
                                                 one_host=layout.nnodes == 1)
        joined = True
        # Rank 0 leaves the group too when it says stop, and never comes otherwise.
        abort = not _serve(_build(cfg, shard), conn)  # the runner and its graphs go with it
        gc.collect()  # before leaving the group: the graphs hold NCCL work captured on it
    except BaseException:
        try:
            if conn is not None:
                conn.send(("error", traceback.format_exc()))
            else:  # no way to rank 0 yet: this node's log is the only place for it
                traceback.print_exc()
        except OSError:
            pass
        sys.exit(1)
    finally:
        if joined:
            process_group.leave_process_group(abort=abort)


def _build(cfg: EngineConfig, shard):
    from ..model import resolve_model
    from ..model.loader import read_model_config
    from ..rank import build_rank, resolve_max_model_len

    source = resolve_model(cfg.model)
    max_len = resolve_max_model_len(cfg, read_model_config(source))
    return build_rank(cfg, source, max_len, shard).runner


def _serve(runner, conn: Connection) -> bool:
    """Runs rank 0's calls in order until it says stop (True), closes the pipe or dies."""
    parent = mp.parent_process()
    while True:
        if not conn.poll(PARENT_POLL_S):
            if parent is not None and not parent.is_alive():
                return False
            continue
        try:
            kind, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return False
        if kind == "launch":
            runner.launch(*args)
        elif kind == "delta":
            runner.apply_delta(*args)
        elif kind == "stop":
            return True
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")
