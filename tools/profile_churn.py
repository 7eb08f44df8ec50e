"""Where a churning run's time goes: host time per Engine.step phase, GPU time of the prefill and
decode replays, and the GPU's idle gaps between them, split by whether the step admitted.

    python tools/profile_churn.py --model llama-1b [--prompt-len 16] [--engine-option k=v ...]

Runs the offline workload of tools/bench.py serve (all requests at t = 0) once, after a warm-up.
The phases are timed by wrapping the engine's own methods on this instance (the engine carries
no profiling code): plan = Scheduler.schedule, launch = ModelRunner.launch (delta and prefill
packing, H2D copies, replays), reconcile = Engine._reconcile (reading results, appending tokens),
rest = everything else in Engine.step (outputs). CUDA events bracket each decode iteration and
each mixed step (prompt chunks beside the decode rows, capture/mixed.py; a speculative engine's
prefill instead); a gap is time on the GPU between the end of one and the start of the next.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import build_engine, drive, parse_engine_option, warm_up  # noqa: E402
from serve_workload import WorkloadConfig, offline_workload  # noqa: E402


def _timed(obj, name: str, totals: dict, key: str) -> None:
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            totals[key] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


def profile(engine, workload) -> dict:
    cuda = engine.config.device.type == "cuda"
    step_phases: list[dict] = []
    totals: dict = defaultdict(float)
    _timed(engine.scheduler, "schedule", totals, "plan")
    _timed(engine.runner, "launch", totals, "launch")
    _timed(engine, "_reconcile", totals, "reconcile")
    prefill_events: list = []
    # A mixed runner's admitting steps are one forward inside the timeline's events
    # (capture/mixed.py): those spans are the "mixed" kind. A speculative runner's prefill runs
    # before its iteration: timed apart, the "prefill" kind.
    mixed = engine.runner.mixed
    if cuda and not mixed:
        inner_prefill = engine.runner._mixed_step

        def prefill(*a, **kw):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = inner_prefill(*a, **kw)
            e.record()
            prefill_events.append((s, e))
            return out
        engine.runner._mixed_step = prefill
    if cuda:
        engine.runner.timeline = []
    inner_step = engine.step

    def step():
        before = dict(totals)
        admitted = engine.scheduler.stats.admitted
        t0 = time.perf_counter()
        out = inner_step()
        total = time.perf_counter() - t0
        row = {k: totals[k] - before.get(k, 0.0) for k in ("plan", "launch", "reconcile")}
        row["rest"] = total - sum(row.values())
        row["total"] = total
        row["admitted"] = engine.scheduler.stats.admitted > admitted
        step_phases.append(row)
        return out
    engine.step = step
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.Event(enable_timing=True)
        base.record()
    trace = drive(engine, workload)
    report = dict(wall_s=trace.wall, steps=len(step_phases),
                  output_tokens=sum(s.output_len for s in workload.requests))
    phases = ("plan", "launch", "reconcile", "rest", "total")
    for label, rows in (("all", step_phases),
                        ("admitting", [r for r in step_phases if r["admitted"]]),
                        ("other", [r for r in step_phases if not r["admitted"]])):
        if rows:
            report[f"host_ms_{label}"] = {
                k: dict(mean=float(np.mean([r[k] for r in rows]) * 1e3),
                        p50=float(np.median([r[k] for r in rows]) * 1e3),
                        p99=float(np.percentile([r[k] for r in rows], 99) * 1e3))
                for k in phases}
            report[f"steps_{label}"] = len(rows)
    if cuda:
        torch.cuda.synchronize()
        spans = [(base.elapsed_time(s), base.elapsed_time(e),
                  "mixed" if mixed and admits else "decode")
                 for s, e, admits in engine.runner.timeline]
        spans += [(base.elapsed_time(s), base.elapsed_time(e), "prefill")
                  for s, e in prefill_events]
        spans.sort()
        ms = {k: sum(e - s for s, e, kind in spans if kind == k)
              for k in ("decode", "prefill", "mixed")}
        count = {k: sum(1 for *_, kind in spans if kind == k) for k in ms}
        gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
        # a gap before an admitting step is its host work (plan, packing, copies)
        before_prefill = [g for g, b in zip(gaps, spans[1:]) if b[2] != "decode"]
        report.update(
            gpu_decode_ms=ms["decode"], gpu_prefill_ms=ms["prefill"], gpu_mixed_ms=ms["mixed"],
            gpu_busy=sum(ms.values()) / (trace.wall * 1e3),
            decode_iterations=count["decode"], prefills=count["prefill"],
            mixed_steps=count["mixed"],
            mean_decode_ms=ms["decode"] / max(1, count["decode"]),
            mean_prefill_ms=ms["prefill"] / max(1, count["prefill"]),
            mean_mixed_ms=ms["mixed"] / max(1, count["mixed"]),
            gaps_ms=dict(sum=float(np.sum(gaps)), p50=float(np.median(gaps)),
                         p99=float(np.percentile(gaps, 99)),
                         before_prefill_sum=float(np.sum(before_prefill)),
                         other_sum=float(np.sum(gaps) - np.sum(before_prefill))))
    report["stats"] = engine.stats_summary()
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--sync", action="store_true", help="sync scheduling (default async)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N functions of most cumulative host time (cProfile "
                         "slows the host: its run's timings are not the bench's)")
    args = ap.parse_args()
    options = dict(parse_engine_option(o) for o in args.engine_option)
    options["async_scheduling"] = not args.sync
    engine = build_engine(args.model, options)
    warm_up(engine, 8)
    cfg = WorkloadConfig(num_requests=args.num_requests, fixed_prompt_len=args.prompt_len)
    workload = offline_workload(cfg, engine.model_config.vocab_size, engine.max_model_len)
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
    report = profile(engine, workload)
    if args.cprofile:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(args.cprofile)
    report.update(model=args.model, prompt_len=args.prompt_len, options=options)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
