"""make demo: a random-weight tiny Llama generating for a batch of prompts; prints tokens/s."""
from __future__ import annotations

import argparse
import random
import time

import torch

from graphexec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(args.model, device=device, max_batch=args.batch)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 64))]
               for _ in range(args.batch)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0 if i % 2 else 0.8,
                             top_p=0.95, seed=i, ignore_eos=True) for i in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    print(f"{args.model} on {device}: {len(outs)} requests, {n} tokens in {elapsed:.2f} s "
          f"= {n / elapsed:,.0f} tokens/s")
    print("first output:", outs[0].token_ids[:16], "...")


if __name__ == "__main__":
    main()
