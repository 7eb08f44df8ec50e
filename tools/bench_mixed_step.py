"""GPU time of a mixed step (capture/mixed.py) beside long-context decode rows.

    python tools/bench_mixed_step.py [--model llama-1b] [--cases 2x4000 48x1000 2x1000]
                                     [--split-rows none 8]

For each case ROWSxCONTEXT: ROWS requests with CONTEXT-token prompts are prefilled and decode,
then a 60-token prompt (one output token) is admitted every other step, so each admitting step
is a mixed step beside those rows. Reports the median GPU time of the mixed steps and of the
plain decode steps (CUDA events of runner.timeline), once per
`AttentionTuning.mixed_split_rows` value (the graphs are captured with it, so each value builds
its own engine). One JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from graphexec import LLM, SamplingParams
from graphexec.capture import mixed
from graphexec.kernels.tuning import tuning_for


def run(model: str, split_rows: int | None, rows: int, context: int, admissions: int) -> dict:
    table = tuning_for(torch.device("cuda"))
    table = replace(table, attention=replace(table.attention, mixed_split_rows=split_rows or 0))
    mixed.tuning_for = lambda device: table
    llm = LLM(model, max_batch=64, max_model_len=context + 1024)
    engine, runner = llm.engine, llm.engine.runner
    try:
        long = SamplingParams(max_tokens=2 * admissions + 64, temperature=0, ignore_eos=True)
        for i in range(rows):
            engine.add_request(f"long{i}", list(range(3 + i, 3 + i + context)), long)
        while any(r.status.name != "RUNNING" for r in engine.requests.values()):
            engine.step()
        for _ in range(4):
            engine.step()
        runner.timeline = []
        short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for j in range(admissions):
            engine.add_request(f"short{j}", list(range(5 + j, 65 + j)), short)
            engine.step()
            engine.step()
        torch.cuda.synchronize()
        spans = [(s.elapsed_time(e), admits) for s, e, admits in runner.timeline]
        runner.timeline = None
    finally:
        llm.close()
    mixed_ms = [ms for ms, admits in spans if admits]
    decode_ms = [ms for ms, admits in spans if not admits]
    return dict(model=model, split_rows=split_rows, rows=rows, context=context,
                mixed_steps=len(mixed_ms), mixed_ms_median=statistics.median(mixed_ms),
                decode_ms_median=statistics.median(decode_ms))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--cases", nargs="+", default=["2x4000", "48x1000", "2x1000"])
    ap.add_argument("--split-rows", nargs="+", default=["none", "8"])
    ap.add_argument("--admissions", type=int, default=80)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mixed_step.py needs CUDA (it times graph replays)")
    for case in args.cases:
        rows, context = (int(x) for x in case.split("x"))
        for value in args.split_rows:
            split = None if value.lower() == "none" else int(value)
            print(json.dumps(run(args.model, split, rows, context, args.admissions)), flush=True)


if __name__ == "__main__":
    main()
