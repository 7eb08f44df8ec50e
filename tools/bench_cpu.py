"""SmolLM2-135M-Instruct on the CPU: graphexec decoding chat prompts as one batch against
transformers' `generate` on the same prompts one after the other (the GGUF file both load).

    python tools/bench_cpu.py [--max-tokens 60] [--threads 2]

Greedy, EOS ignored, so both produce exactly max_tokens per prompt; both run fp32. Prints a
markdown row per engine and the ratio of output tokens/s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import time

import torch

from graphexec import LLM, SamplingParams
from graphexec.model import resolve_model

PROMPTS = ["What is the capital of France?",
           "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue."]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_graphexec(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    llm = LLM("smollm2-135m", device="cpu", dtype="float32", max_batch=len(prompts),
              max_model_len=512)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.token_ids) for o in outs)


def run_transformers(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2-135m").path
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32).eval()
    kw = dict(do_sample=False, min_new_tokens=max_tokens, max_new_tokens=max_tokens,
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **dict(kw, min_new_tokens=2,
                                                          max_new_tokens=2))  # warm-up
        t0 = time.perf_counter()
        n = 0
        for p in prompts:
            out = model.generate(torch.tensor([p]), **kw)
            n += out.shape[1] - len(p)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from graphexec.text.chat import encode_chat

    tok = LLM("smollm2-135m", device="cpu", max_batch=1, max_model_len=64).engine.tokenizer
    prompts = [encode_chat(tok, [{"role": "user", "content": p}]) for p in PROMPTS]
    ge_wall, ge_n = run_graphexec(prompts, args.max_tokens)
    hf_wall, hf_n = run_transformers(prompts, args.max_tokens)
    print(f"Measured {time.strftime('%Y-%m-%d')} on the CPU ({os.cpu_count()} cores, "
          f"{args.threads} threads), torch {torch.__version__}, commit {_commit()}: "
          f"{len(prompts)} chat prompts of {[len(p) for p in prompts]} tokens, "
          f"{args.max_tokens} new tokens each, greedy, fp32.\n")
    print("| engine | wall s | output tok/s |\n|---|---|---|")
    print(f"| graphexec, one batch | {ge_wall:.2f} | {ge_n / ge_wall:.1f} |")
    print(f"| transformers generate, one prompt after another | {hf_wall:.2f} | "
          f"{hf_n / hf_wall:.1f} |")
    print(f"\ngraphexec / transformers: {(ge_n / ge_wall) / (hf_n / hf_wall):.2f}x")


if __name__ == "__main__":
    main()
