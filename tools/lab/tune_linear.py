"""Measure the decode projections on a GPU: every candidate LinearConfig of
kernels/linear_triton.py against cuBLAS (F.linear), per model shape and batch, as it runs in the
decode step: inside a CUDA graph, over enough weight copies that nothing is served from L2.

    python tools/lab/tune_linear.py --models llama-1b llama-8b --batches 1 16 64 --out out/
    python tools/lab/tune_linear.py --models llama-8b --tp 2 --batches 64   # one rank's shapes

Prints, per (shape, M), cuBLAS and the best configs with their fraction of copy bandwidth, and
what the fused RMSNorm and silu * mul prologues cost; writes everything to tune_linear.json.
pick_config's table (kernels/tuning.py, LinearTuning) is to be set from these runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec.kernels import linear_triton as lt  # noqa: E402
from graphexec.kernels import linear_invariant_triton as li  # noqa: E402
from graphexec.kernels import norm_rope_triton as nr  # noqa: E402
from graphexec.kernels.tuning import DEFAULT  # noqa: E402

SHAPES = {  # name -> (hidden, q+2kv, intermediate, vocab)
    "llama-1b": (2048, 3072, 8192, 128256),
    "llama-8b": (4096, 6144, 14336, 128256),
}
L2_DEFEAT_BYTES = 400 * 2**20


def projections(model: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection one rank of tensor_parallel_size tp runs (model/shard.py: qkv,
    gate_up and the LM head split by output rows, o and down by input columns)."""
    h, qkv, inter, vocab = SHAPES[model]
    return {"qkv": (qkv // tp, h), "o": (h, h // tp), "gate_up": (2 * inter // tp, h),
            "down": (h, inter // tp), "lm_head": (vocab // tp, h)}


def candidates(m: int) -> list[lt.LinearConfig]:
    out = []
    if m == 1:
        for bn, bk, split in itertools.product([2, 4, 8, 16], [256, 512, 1024], [1, 2, 4, 8]):
            out.append(lt.LinearConfig(1, bn, bk, split))
    block_ms = [16] if m <= 16 else [16, 64]
    for bm, bn, bk, stages, split in itertools.product(block_ms, [16, 32, 64], [64, 128, 256],
                                                       [3, 4], [1, 2, 4, 8]):
        if bm == 64 and bk == 256:
            continue
        out.append(lt.LinearConfig(bm, bn, bk, split, num_stages=stages))
    return out


def time_graph(fn, copies: int, reps: int = 10) -> float:
    """Seconds per call of fn(i) for i over the copies, replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps / copies


def time_configs(fn, configs, copies: int) -> list[tuple[float, object]]:
    """(microseconds per call of fn(config, i), config) for each config that launches,
    fastest first (one that does not, out of resources and the like, is skipped)."""
    timed = []
    for cfg in configs:
        try:
            t = time_graph(lambda i: fn(cfg, i), copies)
        except Exception as e:
            print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        timed.append((t * 1e6, cfg))
    return sorted(timed, key=lambda p: p[0])


def copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1,
                    help="the shapes one rank of this tensor_parallel_size runs")
    ap.add_argument("--only", nargs="+", default=None, metavar="PROJ",
                    help="just these projections (qkv o gate_up down lm_head)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    dt = torch.bfloat16
    results = []
    os.makedirs(args.out, exist_ok=True)

    def save() -> None:  # after every row: a run cut short by its time limit keeps what it has
        with open(os.path.join(args.out, "tune_linear.json"), "w") as f:
            json.dump(dict(copy_bandwidth=bw, device=torch.cuda.get_device_name(),
                           results=results), f, indent=1)
    for model in args.models:
        for name, (n, k) in projections(model, args.tp).items():
            if args.only and name not in args.only:
                continue
            nbytes = n * k * 2
            copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / nbytes)))
            ws = [torch.randn(n, k, device="cuda", dtype=dt) * k ** -0.5 for _ in range(copies)]
            for m in args.batches:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                floor = (nbytes + m * (k + n) * 2) / bw
                row = dict(model=model, tp=args.tp, proj=name, m=m, n=n, k=k,
                           floor_us=floor * 1e6)
                row["cublas_us"] = time_graph(lambda i: F.linear(x, ws[i]), copies) * 1e6
                timed = time_configs(lambda cfg, i: lt.linear(x, ws[i], config=cfg),
                                     candidates(m), copies)
                row["best"] = [dict(us=us, **cfg.__dict__) for us, cfg in timed[:args.top]]
                shipped = lt.pick_config(m, n, k)
                row["shipped_us"] = time_graph(lambda i: lt.linear(x, ws[i]), copies) * 1e6
                row["shipped"] = shipped.__dict__
                row["invariant_us"] = time_graph(lambda i: li.linear_invariant(x, ws[i]),
                                                 copies) * 1e6
                if name in ("qkv", "gate_up"):  # the norm that feeds them, fused or not
                    r = torch.randn(m, k, device="cuda", dtype=dt)
                    nw = torch.ones(k, device="cuda", dtype=dt)
                    row["fused_norm_us"] = time_graph(
                        lambda i: lt.norm_linear(x, r, nw, 1e-5, ws[i]), copies) * 1e6
                    row["separate_norm_us"] = time_graph(
                        lambda i: lt.linear(nr.add_rms_norm(x, r, nw, 1e-5)[0], ws[i]),
                        copies) * 1e6
                    if m <= DEFAULT.linear.fuse_max_rows:
                        # The fused prologue re-reads the rows in every program, so its best
                        # config may differ from the plain projection's (larger BLOCK_N).
                        fused = []
                        for cfg in candidates(m):
                            try:
                                fused.append((time_graph(lambda i: lt.norm_linear(
                                    x, r, nw, 1e-5, ws[i], config=cfg), copies) * 1e6, cfg))
                            except Exception as e:
                                print(f"  skip fused {cfg}: {type(e).__name__}", file=sys.stderr)
                        fused.sort(key=lambda p: p[0])
                        row["best_fused_norm"] = [dict(us=us, **cfg.__dict__)
                                                  for us, cfg in fused[:args.top]]
                if name == "down":  # the activation that feeds it, fused or not
                    gu = torch.randn(m, 2 * k, device="cuda", dtype=dt)
                    row["fused_act_us"] = time_graph(
                        lambda i: lt.silu_mul_linear(gu, ws[i]), copies) * 1e6
                    row["separate_act_us"] = time_graph(
                        lambda i: lt.linear(lt.silu_mul(gu), ws[i]), copies) * 1e6
                results.append(row)
                save()
                best = timed[0][0] if timed else float("nan")
                line = (f"{model:9s} {name:8s} M={m:<3d} floor {floor * 1e6:7.1f} us | cublas "
                        f"{row['cublas_us']:7.1f} ({floor * 1e6 / row['cublas_us']:.2f}) | best "
                        f"{best:7.1f} ({floor * 1e6 / best:.2f}) {timed[0][1] if timed else ''}"
                        f" | shipped {row['shipped_us']:7.1f} | invariant "
                        f"{row['invariant_us']:7.1f}")
                if "fused_norm_us" in row:
                    line += (f" | norm fused {row['fused_norm_us']:.1f} vs separate "
                             f"{row['separate_norm_us']:.1f}")
                if row.get("best_fused_norm"):
                    b = row["best_fused_norm"][0]
                    line += f" (best fused {b['us']:.1f}: bn {b['block_n']} split {b['split_k']})"
                if "fused_act_us" in row:
                    line += (f" | silu*mul fused {row['fused_act_us']:.1f} vs separate "
                             f"{row['separate_act_us']:.1f}")
                print(line, flush=True)
                for us, cfg in timed[1:args.top]:
                    print(f"{'':30s} {us:7.1f} {cfg}")
            del ws
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
