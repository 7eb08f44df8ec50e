"""Decode step time with one or more entries of the tuning table (kernels/tuning.py) changed,
each run in its own process: a launch config or a threshold changes compiled kernels, and the
overlap of programmatic dependent launch only shows inside a whole decode step, which
tools/lab/tune_linear.py, timing projections one at a time, cannot see.

    python tools/lab/decode_variants.py --model llama-1b --batch 64 \\
        --set linear.fused_min_rows=17 --set linear.l2_prefetch_bytes.qkv=4194304

Without --set it times the shipped table (run both on the same machine to compare). A value is
a Python literal; a dotted path reaches into nested dataclasses and dicts. One process: the
table is changed in this process only (tensor-parallel workers would not see it). Prints one
JSON line.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import bench_graphexec, copy_bandwidth  # noqa: E402
from graphexec.kernels import tuning  # noqa: E402


def changed(table, path: list[str], value):
    """table (a frozen dataclass or a dict) with the entry at path set to value."""
    key, rest = path[0], path[1:]
    old = table[key] if isinstance(table, dict) else getattr(table, key)
    new = changed(old, rest, value) if rest else value
    if isinstance(table, dict):
        return {**table, key: new}
    return dataclasses.replace(table, **{key: new})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--projections", default="auto")
    ap.add_argument("--quantization", default="none", help="none, fp8, int4, int4_asym")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="a tuning table entry, e.g. linear.auto_max_rows=8")
    args = ap.parse_args()
    for item in args.set:
        path, value = item.split("=", 1)
        tuning.DEFAULT = changed(tuning.DEFAULT, path.split("."), ast.literal_eval(value))
    res, llm = bench_graphexec(args.model, "async+graphs", args.batch, 128, 128,
                               copy_bandwidth(), args.batch, projections=args.projections,
                               quantization=args.quantization,
                               kv_cache_dtype=args.kv_cache_dtype)
    llm.close()
    print(json.dumps(dict(set=args.set, model=args.model, batch=args.batch,
                          projections=args.projections, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype,
                          decode_step_ms=round(res["decode_step_ms"], 4),
                          gpu_busy_ms=round(res["gpu_busy_ms"], 4),
                          roofline_frac=round(res["roofline_frac"], 3),
                          gpu_idle_frac=round(res["gpu_idle_frac"], 4),
                          tokens_per_s=round(res["tokens_per_s"]))))


if __name__ == "__main__":
    main()
