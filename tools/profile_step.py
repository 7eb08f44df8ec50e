"""Where one decode iteration's GPU time goes: kernel by kernel, inside the captured graph.

`python tools/profile_step.py --model llama-1b --batch 1 [--replays 20] [--out DIR]`

Brings a batch to steady-state decode, then replays its graph under torch.profiler (CUPTI sees
the kernels inside a graph replay) and prints, per kernel name, calls and GPU time per step,
plus the sum of kernel time against the wall time of a replay: the difference is the gaps
between kernels (launch latency inside the graph), which no faster kernel can remove.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graphexec import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from graphexec.kernels import PROJECTIONS  # noqa: E402
from graphexec.capture.state import Variant  # noqa: E402


def _kernel_times(fn, reps: int) -> dict[str, list]:
    """kernel name -> [calls, total us] over `reps` calls of fn."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name][0] += 1
            per_name[ev.name][1] += ev.time_range.elapsed_us()
    return per_name


def _launch_host_us(replay, reps: int) -> list[float]:
    """Host time of each replay call while the previous replay still runs, as in the async
    loop (launch n, then wait for n - 1). A launch that takes about a step blocked on the GPU."""
    times, events = [], []
    for i in range(reps):
        t = time.perf_counter()
        replay()
        times.append((time.perf_counter() - t) * 1e6)
        events.append(torch.cuda.Event())
        events[-1].record()
        if i:
            events[i - 1].synchronize()
    torch.cuda.synchronize()
    return times[1:]


def profile_step(model: str, batch: int, replays: int, prompt_len: int = 128,
                 projections: str = "auto", spec: str | None = None, spec_k: int = 4) -> dict:
    """spec: a draft ("self:4", a preset or a directory): profile the speculative iteration
    (all-greedy variant) with spec_k draft tokens instead of plain decode."""
    speculative = SpeculativeConfig(spec, spec_k) if spec else None
    llm = LLM(model, max_batch=max(batch, 1), max_model_len=prompt_len + 512,
              buckets=[batch], num_kv_blocks=batch * 48 + 8, projections=projections,
              speculative=speculative)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", list(range(3, 3 + prompt_len)), params)
    for _ in range(4):  # prefill, then plain decode steps with every row running
        engine.step()
    torch.cuda.synchronize()
    # replays advance the rows by up to K + 1 tokens each: stay inside max_tokens and the cache
    variant = Variant(logprobs=False, filters=False, sampled=spec is None)
    for _ in range(3):
        runner.graphs.replay(batch, variant)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        runner.graphs.replay(batch, variant)
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / replays
    launch_us = _launch_host_us(lambda: runner.graphs.replay(batch, variant), replays)
    per_name = _kernel_times(lambda: runner.graphs.replay(batch, variant), replays)
    source = "graph replay"
    if not per_name:  # this CUPTI did not report kernels inside graphs: same kernels, eager
        per_name = _kernel_times(lambda: runner.iterate(batch, variant), replays)
        source = "eager iteration"
    kernels = sorted(((n, c / replays, t / replays) for n, (c, t) in per_name.items()),
                     key=lambda x: -x[2])
    busy = sum(t for _, _, t in kernels)
    launches = sum(c for _, c, _ in kernels)
    while engine.has_unfinished():  # leave the engine clean
        for rid in list(engine.requests):
            if not engine.requests[rid].finished:
                engine.abort(rid)
        engine.step()
    llm.close()
    return dict(model=model, batch=batch, spec=spec, spec_k=spec_k if spec else None,
                kernels_from=source, replay_wall_us=wall_us, kernel_busy_us=busy,
                gap_us=wall_us - busy, kernels_per_step=launches,
                launch_host_us=dict(mean=sum(launch_us) / len(launch_us), max=max(launch_us),
                                    over_half_step=sum(t > wall_us / 2 for t in launch_us)),
                kernels=[dict(name=n[:90], calls=c, us=round(t, 2)) for n, c, t in kernels])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--projections", nargs="+", default=["auto"], choices=PROJECTIONS)
    ap.add_argument("--spec", default=None,
                    help="draft of a speculative engine (e.g. self:4): profile its iteration")
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for b, proj in itertools.product(args.batch, args.projections):
        res = profile_step(args.model, b, args.replays, projections=proj, spec=args.spec,
                           spec_k=args.spec_k)
        tag = f"_spec{args.spec.replace(':', '')}k{args.spec_k}" if args.spec else ""
        path = os.path.join(args.out, f"profile_{args.model}_b{b}_{proj}{tag}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"{args.model} batch {b} ({proj} projections): replay {res['replay_wall_us']:.1f} us, kernels "
              f"{res['kernel_busy_us']:.1f} us, gaps {res['gap_us']:.1f} us, "
              f"{res['kernels_per_step']:.0f} kernels/step; replay call on the host (previous "
              f"replay in flight): mean {res['launch_host_us']['mean']:.1f} us, max "
              f"{res['launch_host_us']['max']:.1f} us, {res['launch_host_us']['over_half_step']} "
              f"of {args.replays - 1} over half a step")
        for k in res["kernels"][:45]:
            print(f"  {k['us']:9.2f} us  x{k['calls']:5.1f}  {k['name']}")


if __name__ == "__main__":
    main()
