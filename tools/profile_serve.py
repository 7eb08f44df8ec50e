"""Where a serving workload's GPU time goes: kernel time by name over a whole run.

`python tools/profile_serve.py --model llama-8b [--engine-option quantization=fp8]
[--num-requests 400] [--prompt-median 300] [--output-median 120] [--top 28] [--out DIR]`

Builds one async engine and warms it up as tools/bench_serve.py does, runs the offline workload
once unprofiled (its wall time is printed beside the profiled one), then the same lengths with
the next seed's token ids under torch.profiler (CUPTI sees the kernels inside graph replays),
and prints each kernel name's calls and total time, largest first, with their sum against the
profiled wall time. Under programmatic dependent launch a kernel's time includes its wait for
the one before, so times overlap and add up to more than the wall: `GRAPHEXEC_PDL=off` gives
times that partition the GPU's work. On a CPU engine the table lists CPU ops instead.

Writes profile_serve_<model>.json (the options, both walls, every name's calls and time) under
--out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402  (tools/, beside this file)
from serve_workload import build_workloads  # noqa: E402


def _offline(engine, workload_args: list[str], seed: int):
    """The offline workload of tools/bench.py serve with these workload arguments."""
    cfg = bench_serve.workload_config(bench_serve.parse_args(workload_args + ["--seed",
                                                                              str(seed)]))
    return build_workloads(cfg, ["offline"], [], engine.model_config.vocab_size,
                           engine.max_model_len)[0]


def _times_by_name(prof, cuda: bool) -> list[dict]:
    """[{name, calls, ms}], largest first: device time of kernels and copies on CUDA, self CPU
    time of ops otherwise."""
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0:
            per_name[ev.key][0] += ev.count
            per_name[ev.key][1] += us
    rows = [dict(name=k, calls=c, ms=us / 1e3) for k, (c, us) in per_name.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def profile_serve(model: str, options: dict, workload_args: list[str], seed: int,
                  warmup: int) -> dict:
    engine = bench_serve.build_engine(model, dict(options, async_scheduling=True))
    try:
        bench_serve.warm_up(engine, warmup)
        t0 = time.perf_counter()
        plain = bench_serve.drive(engine, _offline(engine, workload_args, seed))
        plain_wall = time.perf_counter() - t0
        cuda = engine.config.device.type == "cuda"
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        workload = _offline(engine, workload_args, seed + 1)
        with profile(activities=[activity]) as prof:
            t0 = time.perf_counter()
            trace = bench_serve.drive(engine, workload)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        engine.close()
    kernels = _times_by_name(prof, cuda)
    return dict(model=model, options=options, workload=workload_args, seed=seed,
                device="cuda" if cuda else "cpu", unprofiled_wall_s=plain_wall,
                unprofiled_steps=len(plain.steps), wall_s=wall, steps=len(trace.steps),
                total_ms=sum(k["ms"] for k in kernels), kernels=kernels)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tools/profile_serve.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-1b", help="preset name or model directory")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--prompt-median", type=float, default=300)
    ap.add_argument("--output-median", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to Engine, repeatable (as tools/bench.py serve's)")
    ap.add_argument("--top", type=int, default=28, help="names printed")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    try:
        options = dict(bench_serve.parse_engine_option(o) for o in args.engine_option)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    workload_args = ["--num-requests", str(args.num_requests), "--prompt-median",
                     str(args.prompt_median), "--output-median", str(args.output_median)]
    res = profile_serve(args.model, options, workload_args, args.seed, args.warmup)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_serve_{os.path.basename(args.model)}.json"),
              "w") as f:
        json.dump(res, f, indent=1)
    print(f"{args.model} {options or ''}: wall {res['unprofiled_wall_s']:.2f} s unprofiled, "
          f"{res['wall_s']:.2f} s profiled over {res['steps']} steps; "
          f"{res['total_ms'] / 1e3:.2f} s of {res['device']} time by name", flush=True)
    for k in res["kernels"][:args.top]:
        print(f"  {k['ms']:10.1f} ms {k['calls']:8d}  {k['name'][:100]}")
    return res


if __name__ == "__main__":
    main()
