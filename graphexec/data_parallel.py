"""Data parallelism: whole copies of the engine, one process each, on GPUs of their own.

`replica_options` gives each replica its devices (the server's --data-parallel-size uses it
too); `ReplicaPool` is what `LLM(data_parallel_size=N)` runs its batches on: each replica
process holds an LLM and generates its share of the prompts, and the outputs come back in the
prompts' order.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Sequence

from .config import EngineConfig


def replica_options(model: str, options: dict, replicas: int) -> list[dict]:
    """Each replica's engine options. On CUDA replica r takes the tensor-parallel group of GPUs
    from first + r * tensor_parallel_size on; on the CPU they share the host. ValueError for a
    replica whose GPUs this machine does not have."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {replicas!r}")
    config = EngineConfig(model=model, **options)
    if replicas == 1 or config.device.type != "cuda":
        return [dict(options) for _ in range(replicas)]
    first, tp = config.device.index or 0, config.tensor_parallel_size
    out = []
    for r in range(replicas):
        opts = {**options, "device": f"cuda:{first + r * tp}"}
        try:
            EngineConfig(model=model, **opts)
        except ValueError as e:
            raise ValueError(f"data_parallel_size={replicas}: replica {r}: {e}") from None
        out.append(opts)
    return out


def use_replica_device(options: dict) -> None:
    """Makes the replica's first GPU this process's current CUDA device, so that everything
    not placed explicitly (streams, graph capture, the caching allocator's pool) lands on it
    rather than on GPU 0."""
    import torch

    device = torch.device(options["device"]) if options.get("device") else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def build_replica(model: str, options: dict):
    """A server replica's Engine, in its own engine process."""
    from .engine import Engine

    use_replica_device(options)
    return Engine(model, **options)


def _replica_main(model: str, options: dict, conn) -> None:
    """A replica process: an LLM that answers (prompts, params) with their outputs."""
    try:
        from .llm import LLM

        use_replica_device(options)
        llm = LLM(model, **options)
        conn.send(("ready", llm.engine.tokenizer))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            try:
                conn.send(("outputs", llm.generate(msg[1], msg[2])))
            except ValueError as e:  # a bad prompt: the caller raises it, the replica goes on
                conn.send(("invalid", e))
        llm.close()
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        conn.send(("failed", traceback.format_exc()))


class ReplicaPool:
    def __init__(self, model: str, options: dict, replicas: int):
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA
        self._conns, self._procs = [], []
        for opts in replica_options(model, options, replicas):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_replica_main, args=(model, opts, theirs),
                               name=f"graphexec-replica{len(self._procs)}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self.tokenizer = None
        for r in range(replicas):
            self.tokenizer = self._answer(r, "ready")

    def _answer(self, r: int, want: str):
        try:
            kind, value = self._conns[r].recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {r} exited (code "
                               f"{self._procs[r].exitcode})") from None
        if kind == "invalid":
            raise value
        if kind != want:
            raise RuntimeError(f"data-parallel replica {r} failed:\n{value}")
        return value

    def generate(self, prompts: list, params: Sequence) -> list:
        """Contiguous shares, as even as the count allows; outputs in the prompts' order. A bad
        prompt raises its ValueError (after every replica has answered)."""
        n = len(self._conns)
        bounds = [len(prompts) * r // n for r in range(n + 1)]
        busy = [r for r in range(n) if bounds[r] < bounds[r + 1]]
        for r in busy:
            lo, hi = bounds[r], bounds[r + 1]
            self._conns[r].send(("generate", prompts[lo:hi], list(params[lo:hi])))
        outputs, error = [], None
        for r in busy:
            try:
                outputs += self._answer(r, "outputs")
            except ValueError as e:
                error = error or e
        if error is not None:
            raise error
        return outputs

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._conns, self._procs = [], []
