"""Shared by the tensor-parallel tests: a function on every rank, or an engine, in processes
spawned here (never in the test's own: parallel/symmetric.py maps symmetric memory once a
process), and the sharded forward's logits."""
import torch
import torch.multiprocessing as mp

from graphexec.parallel import process_group
from graphexec.parallel.nodes import NodeLayout

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9, 100, 150]]


def _rank_logits(models: list[str], shard, device: torch.device, dtype: torch.dtype,
                 prompts: list[list[int]] = PROMPTS,
                 projections: str = "cublas") -> list[torch.Tensor]:
    from test_hf_parity import _graphexec_prefill_logits

    return [torch.cat(_graphexec_prefill_logits(m, device, dtype, prompts, shard=shard,
                                                projections=projections)).float().cpu()
            for m in models]


def _one_rank(rank: int, size: int, port: int, fn, args: tuple, device: torch.device,
              conn) -> None:
    device = process_group.rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = process_group.connect_store(NodeLayout(size, port=port))
    shard = process_group.join_process_group(rank, size, device, store)
    try:
        conn.send(fn(shard, device, *args))
        # CPU tensors in the result travel as shared memory that the receiver maps from this
        # process: stay until the test has read every rank's result
        conn.recv()
    finally:
        process_group.leave_process_group()


def _spawn(target, args: tuple, daemon: bool):
    """target(*args, conn) in a new process; returns it and our end of the pipe. Our copy of
    its end is closed, so its death without a reply ends our recv with EOFError."""
    ours, theirs = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(*args, theirs), daemon=daemon)
    p.start()
    theirs.close()
    return p, ours


def _reap(procs: list, wait_s: float) -> None:
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            p.kill()


def on_every_rank(fn, args: tuple, size: int, device: torch.device) -> list:
    """fn(shard, device, *args) on each of `size` ranks, each a process spawned here (gloo on
    the CPU, NCCL over `size` GPUs from `device` on): each rank's result, which must pickle. fn
    must be importable by name (a module-level function). Rank 0 runs in a new process too, not
    in the test's: a process maps symmetric memory for one engine only
    (parallel/symmetric.py), and every call here must get the all-reduce it asks for."""
    store = process_group.host_store(NodeLayout(size))
    spawned = [_spawn(_one_rank, (rank, size, store.port, fn, args, device), daemon=True)
               for rank in range(size)]
    try:
        results = [conn.recv() for _, conn in spawned]
        for _, conn in spawned:
            conn.send(None)
        return results
    finally:
        _reap([p for p, _ in spawned], 10)


def _logits_as_arrays(shard, device: torch.device, models: list[str], dtype: torch.dtype,
                      prompts: list[list[int]], projections: str = "cublas"):
    return [t.numpy() for t in _rank_logits(models, shard, device, dtype, prompts,
                                            projections)]


def sharded_logits(models: list[str], size: int, device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32, prompts: list[list[int]] = PROMPTS,
                   projections: str = "cublas") -> list[list[torch.Tensor]]:
    """Per rank, per model: the prefill logits of prompts (fp32, on the CPU) with the weights
    split over `size` ranks: gloo on the CPU, NCCL over `size` GPUs from `device` on.
    projections: as EngineConfig's ("auto": a rank's epilogue-fused set at 33-64 rows)."""
    ranks = on_every_rank(_logits_as_arrays, (models, dtype, prompts, projections), size,
                          device)
    return [[torch.from_numpy(a) for a in arrays] for arrays in ranks]


def _engine_in_a_process(model: str, opts: dict, reqs: list, conn) -> None:
    from graphexec import Engine
    from test_engine import run_engine

    with Engine(model, **opts) as eng:
        out = run_engine(eng, reqs)
        conn.send((out, eng.stats_summary()["chain_breaks"],
                   type(eng.model.shard.reducer).__name__))


def engine_in_a_process(model: str, opts: dict, reqs: list) -> tuple:
    """run_engine(Engine(model, **opts), reqs) with the engine (rank 0) in a process of its
    own, so that it gets the all-reduce it asks for (tp_helpers.on_every_rank says why): its
    final outputs, its chain breaks, and its all-reduce's class (NoneType: the group's own)."""
    # not a daemon: the engine starts its own worker processes
    p, conn = _spawn(_engine_in_a_process, (model, opts, reqs), daemon=False)
    try:
        return conn.recv()
    finally:
        _reap([p], 30)


class NormingReducer:
    """A reducer with the fused add + norm (parallel/symmetric.TritonAllReduce's interface)
    over the group's own all-reduce and the reference norm: the model's path through
    Shard.all_reduce_norm, on any device. calls counts the fused and the plain ones."""

    def __init__(self, group):
        self.group = group
        self.calls = {"fused": 0, "plain": 0}

    def fits(self, t: torch.Tensor) -> bool:
        return True

    def fits_norm(self, t, residual, norm_weight) -> bool:
        return True

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def __call__(self, t: torch.Tensor, slot: int, pushed: bool = False) -> torch.Tensor:
        assert not pushed, "no push target was given out"
        self.calls["plain"] += 1
        return self._sum(t)

    def add_rms_norm(self, t, residual, norm_weight, eps, slot, pushed=False):
        from graphexec.kernels.rmsnorm import add_rms_norm_ref

        assert not pushed, "no push target was given out"
        self.calls["fused"] += 1
        return add_rms_norm_ref(self._sum(t), residual, norm_weight, eps)


def _logits_through_the_norming_reducer(shard, device: torch.device, models: list[str]):
    """Per model, the logits through a NormingReducer and its calls; then the calls of one
    more forward whose op set refuses the fused norm (Ops.all_reduce_norm)."""
    from dataclasses import replace

    from graphexec.kernels import REFERENCE_OPS
    from test_hf_parity import _graphexec_prefill_logits

    reducer = NormingReducer(shard.group)
    logits = _rank_logits(models, replace(shard, reducer=reducer), device, torch.float32)
    calls = dict(reducer.calls)
    refusing = NormingReducer(shard.group)
    _graphexec_prefill_logits(models[0], device, torch.float32, PROMPTS,
                              ops=replace(REFERENCE_OPS, all_reduce_norm=False),
                              shard=replace(shard, reducer=refusing))
    return [t.numpy() for t in logits], calls, refusing.calls
