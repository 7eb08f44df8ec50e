"""Output tokens/s of one batch with sampling controls against the same batch without, in one
process: penalties on every row, min_p, a logit bias, and (on a model with a tokenizer) every row
or one row under a JSON schema. Prints each mode's tokens/s and its ratio to "plain".

    python tools/bench_sampling.py --model llama-1b --batch 64 --prompt 128 --new 128
    python tools/bench_sampling.py --model smollm2-135m --modes plain json-all json-one
"""
from __future__ import annotations

import argparse
import random
import time

from graphexec import LLM, SamplingParams
from graphexec.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age"]}


def mode_params(mode: str, i: int, new: int) -> SamplingParams:
    """Row i's params in `mode`. Sampled at temperature 1 with a seed, ignore_eos except under
    a grammar (whose outputs end where the grammar does)."""
    base = dict(max_tokens=new, temperature=1.0, seed=i, ignore_eos=True)
    if mode == "penalties":
        return SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5)
    if mode == "repetition":
        return SamplingParams(**base, repetition_penalty=1.2)
    if mode == "min_p":
        return SamplingParams(**base, min_p=0.05)
    if mode == "logit_bias":
        return SamplingParams(**base, logit_bias={t: -5.0 for t in range(100, 400)})
    if mode == "json-all" or (mode == "json-one" and i == 0):
        return SamplingParams(**{**base, "ignore_eos": False},
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return SamplingParams(**base)


MODES = ["plain", "penalties", "repetition", "min_p", "logit_bias", "json-all", "json-one"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=MODES[:5], choices=MODES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    opts = dict(max_batch=args.batch, max_model_len=args.prompt + args.new + 16)
    if args.device:
        opts["device"] = args.device
    llm = LLM(args.model, **opts)
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
    base = None
    print(f"{args.model}, batch {args.batch}, {args.prompt} + {args.new} tokens")
    for mode in args.modes:
        params = [mode_params(mode, i, args.new) for i in range(args.batch)]
        llm.generate(prompts, params)  # warm-up: lazy inits, the grammar compiler
        best = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            best = max(best, sum(len(o.token_ids) for o in outs) / dt)
        base = base or (best if mode == "plain" else None)
        ratio = f"{best / base:.3f}x plain" if base else ""
        print(f"{mode:>11}: {best:10.1f} output tok/s  {ratio}")


if __name__ == "__main__":
    main()
