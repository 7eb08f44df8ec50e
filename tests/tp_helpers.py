"""Shared by the tensor-parallel tests: a sharded forward on every rank (rank 0 in the test's
process, the others spawned here), and engines compared request by request."""
import torch
import torch.multiprocessing as mp

from graphexec.parallel import process_group

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9, 100, 150]]


def _rank_logits(models: list[str], shard, device: torch.device,
                 dtype: torch.dtype) -> list[torch.Tensor]:
    from test_hf_parity import _graphexec_prefill_logits

    return [torch.cat(_graphexec_prefill_logits(m, device, dtype, PROMPTS, shard=shard)).float()
            .cpu() for m in models]


def _one_rank(rank: int, size: int, port: int, fn, args: tuple, conn,
              device: torch.device) -> None:
    device = process_group.rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = process_group.connect_store(port, size)
    shard = process_group.join_process_group(rank, size, device, store)
    try:
        conn.send(fn(shard, device, *args))
        # CPU tensors in the result travel as shared memory that the receiver maps from this
        # process: stay until the test has read every rank's result
        conn.recv()
    finally:
        process_group.leave_process_group()


def on_every_rank(fn, args: tuple, size: int, device: torch.device) -> list:
    """fn(shard, device, *args) on each of `size` ranks, each a process spawned here (gloo on
    the CPU, NCCL over `size` GPUs from `device` on): each rank's result, which must pickle. fn
    must be importable by name (a module-level function). Rank 0 runs in a new process too, not
    in the test's: a process maps symmetric memory for one engine only
    (parallel/symmetric.py), and every call here must get the all-reduce it asks for."""
    ctx = mp.get_context("spawn")
    store = process_group.host_store(size)
    procs, conns = [], []
    for rank in range(size):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_one_rank, daemon=True,
                        args=(rank, size, store.port, fn, args, theirs, device))
        p.start()
        theirs.close()  # a rank that dies without a result then ends recv with EOFError
        procs.append(p)
        conns.append(ours)
    try:
        results = [c.recv() for c in conns]
        for c in conns:
            c.send(None)
        return results
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _logits_as_arrays(shard, device: torch.device, models: list[str], dtype: torch.dtype):
    return [t.numpy() for t in _rank_logits(models, shard, device, dtype)]


def sharded_logits(models: list[str], size: int, device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Per rank, per model: the prefill logits of PROMPTS (fp32, on the CPU) with the weights
    split over `size` ranks: gloo on the CPU, NCCL over `size` GPUs from `device` on."""
    ranks = on_every_rank(_logits_as_arrays, (models, dtype), size, device)
    return [[torch.from_numpy(a) for a in arrays] for arrays in ranks]


def _engine_in_a_process(conn, model: str, opts: dict, reqs: list) -> None:
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
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    # not a daemon: the engine starts its own worker processes
    p = ctx.Process(target=_engine_in_a_process, args=(theirs, model, opts, reqs))
    p.start()
    theirs.close()
    try:
        return ours.recv()
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
