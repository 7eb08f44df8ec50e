"""Where one decode iteration's GPU time goes: kernel by kernel, inside the captured graph.

`python tools/profile_step.py --model llama-1b --batch 1 [--replays 20] [--quantization fp8]
[--out DIR]`
(`--model llama-8b-tp2rank`: one tensor-parallel rank's share, tools/rank_shapes.py)

Brings a batch to steady-state decode, then replays its graph under torch.profiler (CUPTI sees
the kernels inside a graph replay) and prints, per kernel name, calls and GPU time per step,
plus the sum of kernel time against the wall time of a replay: the difference is the gaps
between kernels (launch latency inside the graph), which no faster kernel can remove.

`--engine-gaps STEPS` instead runs the real async loop and times the gaps between iterations;
with `--tp 2` it does so at tensor_parallel_size 2 and reports rank 0's all-reduce time per step
(`GRAPHEXEC_PDL=off` for kernel times that add up to the step).
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
from graphexec.plan import Variant  # noqa: E402

import rank_shapes  # noqa: E402  (tools/, beside this file)


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


def _close(llm) -> None:
    """Aborts what still runs, drains the steps in flight, closes the engine."""
    engine = llm.engine
    while engine.has_unfinished():
        for rid in list(engine.requests):
            if not engine.requests[rid].finished:
                engine.abort(rid)
        engine.step()
    llm.close()


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
                 projections: str = "auto", spec: str | None = None, spec_k: int = 4,
                 quantization: str | None = None) -> dict:
    """spec: a draft ("self:4", a preset or a directory): profile the speculative iteration
    (all-greedy variant) with spec_k draft tokens instead of plain decode. quantization: the
    weights quantized at load ("fp8", "int4")."""
    speculative = SpeculativeConfig(spec, spec_k) if spec else None
    llm = LLM(model, max_batch=max(batch, 1), max_model_len=prompt_len + 512,
              buckets=[batch], num_kv_blocks=batch * 48 + 8, projections=projections,
              speculative=speculative, quantization=quantization)
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
    _close(llm)
    return dict(model=model, batch=batch, spec=spec, spec_k=spec_k if spec else None,
                kernels_from=source, replay_wall_us=wall_us, kernel_busy_us=busy,
                gap_us=wall_us - busy, kernels_per_step=launches,
                launch_host_us=dict(mean=sum(launch_us) / len(launch_us), max=max(launch_us),
                                    over_half_step=sum(t > wall_us / 2 for t in launch_us)),
                kernels=[dict(name=n[:90], calls=c, us=round(t, 2)) for n, c, t in kernels])


def engine_gaps(model: str, batch: int, steps: int, prompt_len: int = 128,
                tp: int = 1) -> tuple[LLM, dict]:
    """The time between decode iterations in the real async loop (engine.step), where the
    copies of results, deltas and the graph launch sit: per-gap statistics from the runner's
    CUDA events, then one profiled stretch that names what the GPU ran inside the gaps and
    what each kernel took per step (rank 0's GPU under tensor parallelism: there the
    all-reduce kernels are listed too; with PDL on, overlapping kernels add up to more than the
    step, so GRAPHEXEC_PDL=off gives shares that add up). Returns the engine, still open, with
    the report: the caller saves the report before closing (a size-2 close once outlived the
    time its device run had left, and the report was lost with it)."""
    llm = LLM(model, max_batch=batch, max_model_len=prompt_len + 2 * steps + 64,
              buckets=[batch], num_kv_blocks=batch * (prompt_len + 2 * steps + 64) // 16 + 8,
              tensor_parallel_size=tp)
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", list(range(3, 3 + prompt_len)), params)
    for _ in range(4):
        engine.step()
    runner.timeline = []
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    tl, runner.timeline = runner.timeline[1:-1], None
    busy = sorted(s.elapsed_time(e) * 1e3 for s, e, _ in tl)
    gaps = sorted(tl[i][1].elapsed_time(tl[i + 1][0]) * 1e3 for i in range(len(tl) - 1))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps // 2):
            engine.step()
        torch.cuda.synchronize()
    ops = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
    non_kernel: dict[str, list] = defaultdict(lambda: [0, 0.0])  # copies and sets: calls, us
    kernels: dict[str, list] = defaultdict(lambda: [0, 0.0])  # every op on the GPU: calls, us
    for s, e, n in ops:
        kernels[n[:90]][0] += 1
        kernels[n[:90]][1] += e - s
    idle: dict[str, list] = defaultdict(lambda: [0, 0.0])  # "before -> after": count, us
    for (s0, e0, n0), (s1, _, n1) in zip(ops, ops[1:]):
        if s1 - e0 > 1.0:
            key = f"{n0[:40]} -> {n1[:40]}"
            idle[key][0] += 1
            idle[key][1] += s1 - e0
    for s, e, n in ops:
        if "emcpy" in n or "emset" in n:
            non_kernel[n[:60]][0] += 1
            non_kernel[n[:60]][1] += e - s
    n_prof = steps // 2

    def stats(xs: list[float]) -> dict:
        return dict(mean=sum(xs) / len(xs), median=xs[len(xs) // 2], p90=xs[int(len(xs) * 0.9)],
                    max=xs[-1])

    per_step = sorted(((k, c / n_prof, t / n_prof) for k, (c, t) in kernels.items()),
                      key=lambda x: -x[2])
    collective_us = sum(t for k, _, t in per_step if "nccl" in k.lower() or "allreduce" in
                        k.replace("_", "").lower())
    return llm, dict(model=model, batch=batch, tensor_parallel_size=tp, steps=len(tl),
                busy_us=stats(busy), gap_us=stats(gaps), profiled_steps=n_prof,
                all_reduce_us_per_step=collective_us,
                kernels_per_step=per_step[:40],
                idle_per_step=sorted(((k, c / n_prof, t / n_prof) for k, (c, t) in idle.items()),
                                     key=lambda x: -x[2])[:20],
                copies_per_step=sorted(((k, c / n_prof, t / n_prof)
                                        for k, (c, t) in non_kernel.items()),
                                       key=lambda x: -x[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--projections", nargs="+", default=["auto"], choices=PROJECTIONS)
    ap.add_argument("--spec", default=None,
                    help="draft of a speculative engine (e.g. self:4): profile its iteration")
    ap.add_argument("--spec-k", type=int, default=4)
    ap.add_argument("--quantization", default=None, choices=["fp8", "int4", "int4_asym"],
                    help="weights quantized at load")
    ap.add_argument("--out", default="out")
    ap.add_argument("--engine-gaps", type=int, default=0, metavar="STEPS",
                    help="instead: time the gaps between iterations of the async loop")
    ap.add_argument("--tp", type=int, default=1,
                    help="with --engine-gaps: tensor_parallel_size (all-reduce time per step)")
    args = ap.parse_args()
    rank_shapes.register(args.model)
    if rank_shapes.is_rank_share(args.model) and args.tp != 1:
        ap.error(f"--model {args.model}: one rank's share runs at --tp 1 only")
    os.makedirs(args.out, exist_ok=True)
    if args.engine_gaps:
        for b in args.batch:
            llm, res = engine_gaps(args.model, b, args.engine_gaps, tp=args.tp)
            tag = f"_tp{args.tp}" if args.tp > 1 else ""
            with open(os.path.join(args.out, f"gaps_{args.model}_b{b}{tag}.json"), "w") as f:
                json.dump(res, f, indent=1)
            print(json.dumps(res, indent=1), flush=True)
            _close(llm)
        return
    for b, proj in itertools.product(args.batch, args.projections):
        res = profile_step(args.model, b, args.replays, projections=proj, spec=args.spec,
                           spec_k=args.spec_k, quantization=args.quantization)
        tag = f"_spec{args.spec.replace(':', '')}k{args.spec_k}" if args.spec else ""
        tag += f"_{args.quantization}" if args.quantization else ""
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
