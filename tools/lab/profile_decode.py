"""Where a decode step's GPU time goes, by kernel: a batch decoded with graphs under
torch.profiler (CUPTI reports each kernel of a replayed graph), summed by kernel name over the
steady steps and divided by their count.

    python tools/lab/profile_decode.py --model llama-8b --batch 64 --quantization none fp8
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec import LLM, SamplingParams  # noqa: E402
from graphexec.model.config import preset  # noqa: E402


def profile(model: str, batch: int, quantization: str, new: int, top: int) -> None:
    vocab = preset(model).vocab_size
    llm = LLM(model, max_batch=batch, num_kv_blocks=batch * 18 + 16, max_model_len=272,
              quantization=quantization, async_scheduling=True, cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True))
    for _ in range(8):  # the prefill and the first decode steps stay out
        engine.step()
    torch.cuda.synchronize()
    steps = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished() and steps < new - 16:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    per = collections.Counter()
    calls = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time_total
            calls[ev.name[:90]] += 1
    total = sum(per.values()) / steps
    print(f"\n{model} batch {batch} {quantization}: {total / 1e3:.3f} ms of kernels a step "
          f"over {steps} steps")
    for name, us in per.most_common(top):
        print(f"{us / steps:9.1f} us {calls[name] / steps:6.1f}/step  {name}")
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--quantization", nargs="+", default=["none", "fp8"])
    args = ap.parse_args()
    for q in args.quantization:
        profile(args.model, args.batch, q, args.new, args.top)


if __name__ == "__main__":
    main()
