"""The all-reduce of tensor parallelism alone, per message size, on two or more GPUs of one host:
the time per all-reduce of a CUDA graph that runs many back to back (slots alternating, as the
model's o and down do), for the kind GRAPHEXEC_ALL_REDUCE picks (parallel/symmetric.py) and for
the group's NCCL all-reduce in the same processes.

    GRAPHEXEC_ALL_REDUCE=triton python tools/bench_all_reduce.py --tp 2 --kib 8 512 4096

A message larger than the kind takes goes to NCCL, as in the model; such rows say so. One kind a
run: a process maps symmetric memory once (parallel/symmetric.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from graphexec.parallel import process_group  # noqa: E402
from graphexec.parallel.nodes import NodeLayout  # noqa: E402

CALLS = 64  # all-reduces a graph: a llama-8b forward's
REPLAYS = 20


def _graph_us(fn, xs: list[torch.Tensor]) -> float:
    """Microseconds per fn(x, i) of a graph over every x in xs, replayed REPLAYS times."""
    for i, x in enumerate(xs):  # eager warm-up: compiles, and runs the slots once
        fn(x, i)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i, x in enumerate(xs):
            fn(x, i)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / REPLAYS / len(xs)


def _rank(rank: int, size: int, port: int, kib: list[int], conn, norm_width: int = 0) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = process_group.connect_store(NodeLayout(size, port=port))
    shard = process_group.join_process_group(rank, size, device, store)
    rows = []
    for k in kib:
        xs = [torch.randn(k * 512, device=device, dtype=torch.bfloat16) for _ in range(CALLS)]
        fits = shard.reducer is not None and shard.reducer.fits(xs[0])
        # (NCCL sums in place: the operands grow by 2x a replay, harmless in bf16's range)
        ours = _graph_us(lambda x, i: shard.all_reduce(x, i % 2), xs)
        nccl = _graph_us(lambda x, i: dist.all_reduce(x, group=shard.group), xs)
        row = dict(kib=k, reducer=type(shard.reducer).__name__ if fits else "NCCL",
                   us=ours, nccl_us=nccl)
        if norm_width and xs[0].numel() % norm_width == 0:  # with the add and the next norm
            shaped = [x.view(-1, norm_width) for x in xs]
            residual = torch.randn_like(shaped[0])
            weight = torch.ones(norm_width, device=device, dtype=torch.bfloat16)
            if shard.reducer is not None and shard.reducer.fits_norm(shaped[0], residual,
                                                                     weight):
                row["norm_us"] = _graph_us(lambda x, i: shard.reducer.add_rms_norm(
                    x, residual, weight, 1e-5, i % 2), shaped)
        rows.append(row)
    conn.send(rows)
    process_group.leave_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kib", nargs="+", type=int, default=[8, 64, 512, 1024, 2048, 4096])
    ap.add_argument("--norm-width", type=int, default=0,
                    help="also time the all-reduce with the residual add and RMSNorm fused, "
                         "the message as rows of this many elements (llama-8b: 4096)")
    args = ap.parse_args()
    store = process_group.host_store(NodeLayout(args.tp))
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(args.tp):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_rank, args=(rank, args.tp, store.port, args.kib, theirs,
                                                args.norm_width))
        p.start()
        theirs.close()
        pipes.append(ours)
        procs.append(p)
    results = [c.recv() for c in pipes]
    for p in procs:
        p.join(60)
    kind = os.environ.get("GRAPHEXEC_ALL_REDUCE", "default")
    print(f"GRAPHEXEC_ALL_REDUCE={kind}, {args.tp} x {torch.cuda.get_device_name(0)}, "
          f"us per all-reduce (rank 0; the slowest rank in brackets), {CALLS} a graph")
    for i, row in enumerate(results[0]):
        worst = max(r[i]["us"] for r in results)
        worst_nccl = max(r[i]["nccl_us"] for r in results)
        print(f"{row['kib']:6d} KiB  {row['reducer']:>14s} {row['us']:7.2f} ({worst:.2f})"
              f"   NCCL {row['nccl_us']:7.2f} ({worst_nccl:.2f})"
              + (f"   with add + norm {row['norm_us']:7.2f}" if "norm_us" in row else ""))
    print(json.dumps(dict(kind=kind, tp=args.tp, rows=results)))


if __name__ == "__main__":
    main()
