"""Measure the quantized projections on a GPU: every candidate tile of
kernels/linear_quant_triton.py (W8A16, W4A16) against the dense bf16 projection (cuBLAS) and
the floor of the bytes each format reads, per model shape and batch, inside a CUDA graph over
enough weight copies that nothing is served from L2 (tools/lab/tune_linear.py's harness).

    python tools/lab/tune_quant_linear.py --models llama-8b --batches 1 16 64 --out out/

Prints, per (format, projection, M), the floor, cuBLAS on the bf16 weight, the shipped
config (this GPU's table: kernels/tuning.py tuning_for) and the best candidates (above
QuantLinearTuning.max_rows "shipped" is the dense fallback, dequantize + cuBLAS), and for fp8
W8A8 on torch._scaled_mm; writes tune_quant_linear.json. QuantLinearTuning (kernels/tuning.py)
is to be set from these runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec.kernels import linear_quant_triton as lq  # noqa: E402
from graphexec.kernels.linear_fp8_rows import linear_fp8_rows  # noqa: E402
from graphexec.kernels.quant import dequantize, quantize_fp8, quantize_int4  # noqa: E402
from graphexec.kernels.tuning import LinearConfig, tuning_for  # noqa: E402
from tune_linear import (L2_DEFEAT_BYTES, copy_bandwidth, projections, time_configs,  # noqa: E402
                         time_graph)

FORMATS = {"fp8": quantize_fp8, "int4": lambda w: quantize_int4(w, 128),
           "int4_asym": lambda w: quantize_int4(w, 128, symmetric=False)}


def candidates(m: int, int4: bool) -> list[LinearConfig]:
    """Tiles to try: fp8's one row on CUDA cores or padded to a 16-row tensor-core tile; more
    rows, and int4 always, on tensor-core tiles. An int4 tile is at most a group (128) deep."""
    def grid(bms, bns, bks, splits, stages, warps):
        for bm, bn, bk, split, st, w in itertools.product(bms, bns, bks, splits, stages, warps):
            if not (int4 and bk > 128):
                yield LinearConfig(bm, bn, bk, split, num_warps=w, num_stages=st)

    if int4:  # whole 64-column blocks, a group (128) deep
        splits = [1, 2, 4, 8, 16]
        if m > 64:  # prefill chunks: against the dense copy + cuBLAS that runs there
            return list(grid([64, 128], [128, 256], [128], [1, 2], [3, 4], [4, 8]))
        if m > 16:
            return list(grid([32, 64], [64, 128, 256], [128], splits, [2, 3, 4], [4, 8]))
        return list(grid([16], [32, 64, 128], [128], splits, [2, 3, 4], [4]))
    if m == 1:
        return [*grid([1], [4, 8, 16, 32], [512, 1024, 2048], [1, 2, 4], [3], [4, 8]),
                *grid([16], [32, 64], [128, 256], [1, 2, 4], [3], [4])]
    if m <= 16:
        return list(grid([16], [32, 64, 128], [128, 256], [1, 2, 4], [3, 4], [4]))
    return list(grid([64], [32, 64, 128], [128, 256], [1, 2], [3, 4], [4, 8]))


def _compile_share(table, share: list[tuple[str, int, int, int, LinearConfig]]) -> None:
    """Launch each (format, m, n, k, tile) once under `table` (QuantLinearTuning), so that its
    kernel lands in Triton's cache."""
    inputs: dict = {}  # one quantized weight and input per (format, m, n, k), not per tile
    for fmt, m, n, k, cfg in share:
        if (fmt, m, n, k) not in inputs:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            inputs[fmt, m, n, k] = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                    FORMATS[fmt](w))
        x, q = inputs[fmt, m, n, k]
        try:
            lq.linear_quant(x, q, config=cfg, t=table)
        except Exception:
            pass  # time_configs skips it again and says why
    torch.cuda.synchronize()


def precompile(table, jobs: list[tuple[str, int, int, int, LinearConfig]],
               workers: int) -> None:
    """Compile the sweep's kernels on `workers` processes at once (one compile takes seconds,
    a launch microseconds); the timing then runs on a warm cache."""
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_compile_share, [(table, jobs[i::workers]) for i in range(workers)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--only", nargs="+", default=None, metavar="PROJ",
                    help="just these projections (qkv o gate_up down)")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--out", default=".")
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes compiling the candidates before any is timed")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    table = tuning_for(torch.device("cuda")).quant_linear  # this GPU's, for every launch
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    results = []
    os.makedirs(args.out, exist_ok=True)
    if args.compile_workers > 1:  # one shape per format and m: the tiles compile the same
        jobs = [(fmt, m, *projections(model)["qkv"], cfg)
                for model, fmt, m in itertools.product(args.models, args.formats, args.batches)
                for cfg in candidates(m, fmt != "fp8")]
        try:
            precompile(table, jobs, args.compile_workers)
        except Exception as e:  # the timing compiles what is missing, one at a time
            print(f"precompile failed: {type(e).__name__}: {e}", file=sys.stderr)

    def save() -> None:  # after every row: a run cut short keeps what it has
        with open(os.path.join(args.out, "tune_quant_linear.json"), "w") as f:
            json.dump(dict(copy_bandwidth=bw, device=torch.cuda.get_device_name(),
                           results=results), f, indent=1)
    for model, fmt in itertools.product(args.models, args.formats):
        for name, (n, k) in projections(model).items():
            if name == "lm_head" or (args.only and name not in args.only):
                continue  # the LM head stays dense
            dense_bytes = n * k * 2
            w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            q0 = FORMATS[fmt](w0)
            copies = max(1, min(64, math.ceil(L2_DEFEAT_BYTES / q0.nbytes)))
            qs = [q0] + [FORMATS[fmt](torch.randn_like(w0) * k ** -0.5)
                         for _ in range(copies - 1)]
            dense = [dequantize(q) for q in qs[:max(1, math.ceil(L2_DEFEAT_BYTES
                                                                / dense_bytes))]]
            for m in args.batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floor = (q0.nbytes + m * (k + n) * 2) / bw
                row = dict(model=model, format=fmt, proj=name, m=m, n=n, k=k,
                           floor_us=floor * 1e6, bytes=q0.nbytes)
                row["cublas_bf16_us"] = time_graph(lambda i: F.linear(x, dense[i]),
                                                   len(dense)) * 1e6
                row["shipped_us"] = time_graph(lambda i: lq.linear_quant(x, qs[i], t=table),
                                               copies) * 1e6
                if fmt == "fp8":  # W8A8 on the fp8 tensor cores (fp8_scaled_mm_min_rows)
                    row["scaled_mm_us"] = time_graph(lambda i: linear_fp8_rows(x, qs[i]),
                                                     copies) * 1e6
                timed = time_configs(
                    lambda cfg, i: lq.linear_quant(x, qs[i], config=cfg, t=table),
                    candidates(m, fmt != "fp8"), copies)
                row["best"] = [dict(us=us, **cfg.__dict__) for us, cfg in timed[:args.top]]
                results.append(row)
                save()
                best = timed[0][0] if timed else float("nan")
                print(f"{model} {fmt:9s} {name:8s} M={m:<3d} floor {floor * 1e6:7.1f} us | "
                      f"bf16 cublas {row['cublas_bf16_us']:7.1f} | shipped "
                      f"{row['shipped_us']:7.1f} ({floor * 1e6 / row['shipped_us']:.2f}) | best "
                      f"{best:7.1f} ({floor * 1e6 / best:.2f}) "
                      f"{timed[0][1] if timed else ''}"
                      + (f" | scaled_mm {row['scaled_mm_us']:7.1f}" if fmt == "fp8" else ""),
                      flush=True)
            del qs, dense
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
