"""make demo: SmolLM2-135M-Instruct answers a few chat prompts, batched, the first answer streamed
as it is generated; then tokens/s. `--model tiny` runs the random-weight tiny Llama on random
token ids instead (no tokenizer: token ids out)."""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from graphexec import LLM, Engine, SamplingParams
from graphexec.text.chat import encode_chat
from graphexec.model.config import PRESETS

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m (default), a GGUF file, an HF dir, or a preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--batch", type=int, default=32, help="requests of the token-id demo")
    # A 135M model at batch 4 gains little from intra-op threads, and on a host whose cores
    # are busy with other work they spin against each other: SmolLM2 ran at 0.8 tokens/s with
    # torch's default of two threads on a shared 2-core machine, 10.6 with one.
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for torch (default 1; 0: torch's default)")
    args = ap.parse_args()
    if args.threads > 0 and args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.model in PRESETS:  # random weights, no tokenizer
        token_demo(args)
    else:
        chat_demo(args)


def chat_demo(args) -> None:
    start = time.perf_counter()
    # The prompts are under 64 tokens; a short context keeps the KV cache (and the CPU
    # reference attention, which spans the whole context) small.
    engine = Engine(args.model, device=args.device, max_batch=len(QUESTIONS),
                    max_model_len=64 + args.max_tokens)
    tok = engine.tokenizer
    if tok is None or not tok.chat_template:
        sys.exit(f"{args.model}: no tokenizer with a chat template; try --model tiny")
    print(f"{args.model} on {args.device}: loaded in {time.perf_counter() - start:.1f} s")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    run(engine, [prompts[0]], SamplingParams(max_tokens=2))  # warm-up, not timed

    # All questions run as one batch. The first answer is printed as its text arrives; the
    # others are printed whole when they finish (after the first), so nothing interleaves.
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    print(f"\n[1] {QUESTIONS[0]}\n    ", end="", flush=True)
    first_done, ready, tokens = False, [], 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.request_id == "0":
                print(_indent(out.new_text), end="", flush=True)
                first_done = out.finished
            elif out.finished:
                ready.append(out)
        if first_done:
            for out in ready:
                i = int(out.request_id)
                print(f"\n\n[{i + 1}] {QUESTIONS[i]}\n    {_indent(out.text)}", end="")
            ready = []
    elapsed = time.perf_counter() - start
    print(f"\n\n{len(prompts)} answers, {tokens} tokens in {elapsed:.2f} s = "
          f"{tokens / elapsed:,.1f} tokens/s (batch of {len(prompts)}, prefill included)")
    engine.close()


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")


def run(engine: Engine, prompts, params) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"warm-{i}", p, params)
    while engine.has_unfinished():
        engine.step()


def token_demo(args) -> None:
    llm = LLM(args.model, device=args.device, max_batch=args.batch)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 64))]
               for _ in range(args.batch)]
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0 if i % 2 else 0.8,
                             top_p=0.95, seed=i, ignore_eos=True) for i in range(args.batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    print(f"{args.model} on {args.device}: {len(outs)} requests, {n} tokens in {elapsed:.2f} s "
          f"= {n / elapsed:,.0f} tokens/s")
    print("first output:", outs[0].token_ids[:16], "...")
    llm.close()


if __name__ == "__main__":
    main()
