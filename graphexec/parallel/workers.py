"""WorkerGroup: rank 0's handle on the tensor-parallel worker processes. It starts them, sends
them each step's launch, notices when one has died, and ends them.

Rank 0 never waits on a worker here: a send is one write to a pipe (pickled once for all of
them), a liveness check one waitpid per worker. The ranks meet only in the all-reduces inside
the forward, and a collective that fails is turned into a TensorParallelError that says which
worker is gone and why."""
from __future__ import annotations

import pickle
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import EngineConfig
from ..model.shard import Shard
from . import nodes, process_group
from .nodes import NodeLayout
from .worker import worker_main

# How long close() lets a worker finish its last step and leave before ending it by signal.
CLOSE_TIMEOUT_S = 10.0
# How long rank 0 waits for the group's shutdown, which waits for every worker to reach it.
LEAVE_TIMEOUT_S = 60.0
# How long a collective's failure waits for the worker that caused it to be seen as exited
# (a killed peer's sockets close a moment before its parent can reap it).
REAP_GRACE_S = 2.0


class TensorParallelError(RuntimeError):
    """A worker died, hung or failed: the engine cannot run another step."""


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection  # rank 0's end: launches out; hello and the worker's last error back
    report: str = ""  # what the worker said before it exited (a traceback)


@dataclass
class WorkerGroup:
    workers: list[_Worker]
    shard: Shard | None = None  # rank 0's, once the process group is joined
    failure: TensorParallelError | None = None
    _store: object | None = field(default=None, repr=False)
    _joining: bool = False  # set before the process group is joined: close() must leave it

    @classmethod
    def start(cls, cfg: EngineConfig) -> "WorkerGroup":
        """Spawns this host's other ranks, takes the other nodes' (nodes.py), and joins the
        process group with them as rank 0."""
        size = cfg.tensor_parallel_size
        layout = NodeLayout.of(cfg)
        if layout.node_rank != 0:
            raise ValueError(f"node_rank={layout.node_rank}: the engine runs on node 0; the "
                             "other nodes run workers only (graphexec-serve --node-rank N)")
        if dist.is_initialized():
            raise ValueError(f"tensor_parallel_size={size}: this process already belongs to a "
                             "torch.distributed group (another tensor-parallel Engine still "
                             "open?): close it first")
        ctx = mp.get_context("spawn")
        store = process_group.host_store(layout)
        layout = replace(layout, port=store.port)
        group = cls([], _store=store)
        try:
            channel = nodes.open_channel(layout, store) if layout.nnodes > 1 else None
            for rank in layout.ranks()[1:]:
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"graphexec-tp-rank{rank}",
                                   args=(cfg, rank, layout, theirs), daemon=True)
                proc.start()
                theirs.close()
                group.workers.append(_Worker(rank, proc, ours))
            group._await_hello()
            if channel is not None:
                remote = nodes.accept_remote(channel, layout,
                                             process_group.START_TIMEOUT.total_seconds(),
                                             group.check)
                group.workers += [_Worker(r, nodes.RemoteWorker(c, r), c)
                                  for r, c in sorted(remote.items())]
            group._joining = True
            group.shard = process_group.join_process_group(0, size, cfg.device, store,
                                                           one_host=layout.nnodes == 1)
        except BaseException:
            group.close()
            raise
        return group

    def _await_hello(self) -> None:
        """Each worker says hello before the rendezvous: one that fails to start (an import
        error, a bad device) is reported now rather than waited for until START_TIMEOUT."""
        deadline = time.monotonic() + process_group.START_TIMEOUT.total_seconds()
        for w in self.workers:
            while not w.conn.poll(0.05):
                self.check()
                if time.monotonic() > deadline:
                    raise self._fail(f"tensor-parallel worker rank {w.rank} did not start "
                                     f"within {process_group.START_TIMEOUT}")
            try:
                msg = w.conn.recv()
            except EOFError:  # it exited before a word (spawn re-running an unguarded main)
                msg = ("error", "")
            if msg[0] != "hello":
                w.report = msg[1]
                w.process.join(REAP_GRACE_S)
                self.check()
                raise self._fail(f"tensor-parallel worker rank {w.rank} failed to start"
                                 f"{':' if w.report else ''}\n{w.report}")

    # -- steps --------------------------------------------------------------------------------

    def send(self, kind: str, *args) -> None:
        """Hands every worker the same call to make on its runner."""
        self.check()
        payload = pickle.dumps((kind, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for w in self.workers:
                w.conn.send_bytes(payload)
        except OSError as e:  # the pipe of a worker that has exited
            self._await_exit()
            self.check()
            raise self._fail(f"cannot reach the tensor-parallel workers ({e})") from e

    def check(self) -> None:
        """Raises if a worker has exited (or an earlier failure left the ranks out of step)."""
        if self.failure is not None:
            raise self.failure
        for w in self.workers:
            code = w.process.exitcode
            if code is None:
                continue
            if isinstance(w.process, nodes.RemoteWorker):
                w.report, how = w.process.report, w.process.how
            else:
                if not w.report and w.conn.poll():
                    try:
                        w.report = w.conn.recv()[1]
                    except (EOFError, OSError):
                        pass
                how = (f"was killed by signal {-code}" if code < 0 else
                       f"exited with code {code}")
            detail = f":\n{w.report}" if w.report else ""
            raise self._fail(f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) "
                             f"{how}{detail}")

    @contextmanager
    def watch(self):
        """Around rank 0's share of a step: a collective that fails because a worker died
        raises a TensorParallelError naming it. Any failure leaves the ranks out of step, so
        every later step raises too."""
        try:
            yield
        except TensorParallelError:
            raise
        except ValueError as e:  # bad input (at build: a draft that does not split), every
            # rank raises the same: rank 0's own error is the one to show
            self._fail(f"rank 0 raised {e!r}; the tensor-parallel ranks are out of step")
            raise
        except Exception as e:
            self._await_exit()
            self.check()
            self._fail(f"rank 0 failed during a step ({type(e).__name__}: {e}); the "
                       "tensor-parallel ranks are out of step")
            raise

    def wait_for(self, event) -> float:
        """Waits for a CUDA event, checking the workers meanwhile: a dead peer leaves the
        all-reduce, and so the event, waiting forever. Returns the seconds waited."""
        if event.query():
            return 0.0
        t0 = time.perf_counter()
        while not event.query():
            self.check()
            time.sleep(50e-6)
        return time.perf_counter() - t0

    def _await_exit(self) -> None:
        deadline = time.monotonic() + REAP_GRACE_S
        while time.monotonic() < deadline and all(w.process.is_alive() for w in self.workers):
            time.sleep(0.01)

    def _fail(self, message: str) -> TensorParallelError:
        if self.failure is None:
            self.failure = TensorParallelError(message)
        return self.failure

    # -- end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Ends every worker: asked first, by signal after CLOSE_TIMEOUT_S. Idempotent."""
        stop = pickle.dumps(("stop", ()))
        for w in self.workers:
            try:
                w.conn.send_bytes(stop)
            except OSError:
                pass
        # Leave the group while the workers leave theirs: an NCCL shutdown may wait for every
        # rank, so waiting for the workers to exit first would hang both sides until the
        # signal below, and then rank 0 on a peer that is gone.
        if self._joining:
            if not process_group.leave_process_group(abort=self.failure is not None,
                                                     timeout_s=LEAVE_TIMEOUT_S):
                print("graphexec: leaving the tensor-parallel process group timed out",
                      file=sys.stderr)
            self.shard, self._joining = None, False
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        self.workers = []
        self._store = None
