"""Tensor parallelism over several hosts, as SGLang starts it (--nnodes, --node-rank,
--dist-init-addr): the ranks are split evenly over the nodes, node k holding ranks
k * per_node .. (k + 1) * per_node - 1. Node 0 runs the engine (rank 0 and the host loop) and
its own workers; every other node runs workers only (`run_node`).

Two things cross hosts. The rendezvous: a torch.distributed TCPStore that node 0 hosts at
dist_init_addr, after which the collectives run on NCCL (gloo on the CPU); the custom Triton
all-reduce needs every rank's memory on one host, so a multi-node group uses the backend's
own. And each step's launch: a local worker reads it from a pipe, a remote one from a socket
of the launch channel, a multiprocessing Listener that node 0 opens at port + 1. Both are
`multiprocessing.connection.Connection`s, so a worker serves either the same way; its key is
a random one node 0 leaves in the store.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

_AUTHKEY = "graphexec/launch-key"


@dataclass(frozen=True)
class NodeLayout:
    size: int  # tensor_parallel_size: ranks over all nodes
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: a single node, whose store takes a port the OS picks

    @classmethod
    def of(cls, cfg) -> "NodeLayout":
        """From an EngineConfig; ValueError naming the option that is wrong."""
        size, nnodes, node_rank = cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank
        if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
            raise ValueError(f"nnodes must be a positive integer, got {nnodes!r}")
        if not isinstance(node_rank, int) or isinstance(node_rank, bool) or not (
                0 <= node_rank < nnodes):
            raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank!r}")
        if nnodes == 1:
            return cls(size)
        if size % nnodes:
            raise ValueError(f"tensor_parallel_size={size} must be a multiple of "
                             f"nnodes={nnodes}: every node runs as many ranks")
        addr = cfg.dist_init_addr
        host, _, port = (addr or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"dist_init_addr must be 'host:port' (node 0's address, port and "
                             f"port + 1 free) with nnodes={nnodes}, got {addr!r}")
        return cls(size, nnodes, node_rank, host, int(port))

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    def ranks(self, node: int | None = None) -> range:
        node = self.node_rank if node is None else node
        return range(node * self.per_node, (node + 1) * self.per_node)

    def local_index(self, rank: int) -> int:
        """The rank's place on its own node: its CUDA device from `device` on."""
        return rank - (rank // self.per_node) * self.per_node


# -- the launch channel ----------------------------------------------------------------------

def open_channel(layout: NodeLayout, store) -> Listener:
    """Node 0: listens for the other nodes' workers, its key left in the store for them."""
    key = secrets.token_bytes(32)
    listener = Listener((layout.host, layout.port + 1), authkey=key)
    store.set(_AUTHKEY, key)
    return listener


def accept_remote(listener: Listener, layout: NodeLayout, timeout_s: float,
                  alive=lambda: None) -> dict[int, Connection]:
    """Node 0: the other nodes' workers, each saying hello with its rank, within timeout_s.
    alive() is called meanwhile and may raise (a local worker that died)."""
    want = set(range(layout.per_node, layout.size))
    got: dict[int, Connection] = {}
    failure: list[BaseException] = []

    def accept() -> None:
        try:
            while want - got.keys():
                conn = listener.accept()
                kind, rank = conn.recv()
                if kind != "hello" or rank not in want or rank in got:
                    conn.close()
                    continue
                got[rank] = conn
        except (OSError, EOFError) as e:
            failure.append(e)

    thread = threading.Thread(target=accept, name="graphexec-launch-accept", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while thread.is_alive():
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(want - got.keys())} of the other nodes did "
                                   f"not connect to {layout.host}:{layout.port + 1} within "
                                   f"{timeout_s:g} s")
            thread.join(0.05)
    finally:
        listener.close()  # also ends a pending accept
    if failure and want - got.keys():
        raise RuntimeError(f"the launch channel failed: {failure[0]!r}")
    return got


def connect_channel(layout: NodeLayout, store, rank: int) -> Connection:
    """A remote worker: its connection to node 0, hello said."""
    conn = Client((layout.host, layout.port + 1), authkey=store.get(_AUTHKEY))
    conn.send(("hello", rank))
    return conn


class RemoteWorker:
    """What WorkerGroup needs of a worker process, for one on another node, seen through its
    connection: it has ended once the connection has something to read (its last error) or
    is closed."""

    def __init__(self, conn: Connection, rank: int):
        self.conn, self.pid = conn, f"rank {rank} on another node"
        self.report = ""
        self.how: str | None = None

    @property
    def exitcode(self) -> int | None:
        if self.how is None:
            try:
                if not self.conn.poll():
                    return None
                self.report = self.conn.recv()[1]
                self.how = "failed"
            except (EOFError, OSError):
                self.how = "lost its connection"
        return 1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def terminate(self) -> None:
        self.conn.close()  # the worker reads EOF and leaves
        self.how = self.how or "was disconnected"

    kill = terminate


def run_node(cfg) -> int:
    """A node other than 0: starts its ranks' workers, which reach node 0 on their own, and
    waits for them. Returns the exit status (the first failing worker's)."""
    import multiprocessing as mp

    from .worker import worker_main

    layout = NodeLayout.of(cfg)
    if layout.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine, not run_node")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, name=f"graphexec-tp-rank{rank}",
                         args=(cfg, rank, layout, None)) for rank in layout.ranks()]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return next((p.exitcode for p in procs if p.exitcode), 0)
