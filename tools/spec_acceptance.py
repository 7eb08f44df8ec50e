"""How often SmolLM2's self-drafts are accepted: the demo's chat prompts, greedy, for a few draft
depths (self:N, the target's first N layers) and draft lengths K. Prints a markdown table.

    python tools/spec_acceptance.py [--layers 4 8 15 24] [--k 2 4] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from demo import QUESTIONS
from graphexec import LLM, SamplingParams, SpeculativeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 15, 24])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    opts = dict(device=args.device, max_batch=len(convs), max_model_len=64 + args.max_tokens)

    with LLM(args.model, **opts) as llm:
        plain = [o.token_ids for o in llm.chat(convs, greedy)]
        num_layers = llm.engine.model_config.num_layers
    print(f"{args.model} ({num_layers} layers) on {args.device}, greedy, "
          f"{len(convs)} chat prompts, max_tokens={args.max_tokens}\n")
    print("| draft | K | drafted | accepted | acceptance | tokens per verify | same output | s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.layers:
        for k in args.k:
            start = time.perf_counter()
            with LLM(args.model, speculative=SpeculativeConfig(f"self:{n}", k), **opts) as llm:
                outs = llm.chat(convs, greedy)
            secs = time.perf_counter() - start
            drafted = sum(o.num_drafted_tokens for o in outs)
            accepted = sum(o.num_accepted_tokens for o in outs)
            verifies = drafted / k  # each verify step drafts K for its request
            same = [o.token_ids for o in outs] == plain
            print(f"| self:{n} | {k} | {drafted} | {accepted} | {accepted / drafted:.1%} | "
                  f"{1 + accepted / verifies:.2f} | {'yes' if same else 'NO'} | {secs:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
