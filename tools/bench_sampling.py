"""Output tokens/s of one batch with sampling controls against the same batch without, in one
process: penalties on every row, min_p, a logit bias, and every row (json_all) or one row
(json_one) under a JSON schema. Prints a table of each mode's tokens/s, its ratio to "plain"
and the GPU's idle fraction between decode steps; writes it as JSON under --out.

A preset ships no tokenizer; for the JSON modes one is trained to the preset's vocabulary
(tools/synthetic_tokenizer.py) so xgrammar's masks cost what a real vocabulary's would.

    python tools/bench_sampling.py --model llama-1b --batch 64 --prompt 128 --new 128 \\
        --modes plain json_all json_one penalties --out out/sampling
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graphexec import LLM, SamplingParams  # noqa: E402
from graphexec.structured import Grammars, StructuredOutputsParams  # noqa: E402
import synthetic_tokenizer  # noqa: E402  (tools/, beside this file)

# A record of the size a tool call or extraction asks for: strings, an integer, an enum, a
# boolean and an array. Lengths and counts are bounded so a row sampled from random weights can
# close its object within a few hundred tokens instead of writing one string forever.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 4},
    },
    "required": ["name", "email", "age", "role", "active", "tags"],
    "additionalProperties": False,
}

MODES = ["plain", "penalties", "repetition", "min_p", "logit_bias", "json_all", "json_one"]
_ALIASES = {"json-all": "json_all", "json-one": "json_one"}  # earlier spellings


def constrained(mode: str, i: int) -> bool:
    return mode == "json_all" or (mode == "json_one" and i == 0)


def mode_params(mode: str, i: int, new: int) -> SamplingParams:
    """Row i's params in `mode`. Sampled at temperature 1 with a seed and ignore_eos, except
    under a grammar: SamplingParams refuses ignore_eos there (the output ends where the grammar
    does), so a grammar row runs to the end of its object or to max_tokens."""
    base = dict(max_tokens=new, temperature=1.0, seed=i, ignore_eos=True)
    if mode == "penalties":
        return SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5)
    if mode == "repetition":
        return SamplingParams(**base, repetition_penalty=1.2)
    if mode == "min_p":
        return SamplingParams(**base, min_p=0.05)
    if mode == "logit_bias":
        return SamplingParams(**base, logit_bias={t: -5.0 for t in range(100, 400)})
    if constrained(mode, i):
        return SamplingParams(**{**base, "ignore_eos": False},
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return SamplingParams(**base)


def attach_tokenizer(llm: LLM, model: str, detokenize: bool):
    """Gives a preset the synthetic tokenizer and returns it (None: the model has its own).
    Without detokenize only the grammar compiler gets it, so no mode pays for streaming text
    and the JSON modes differ from plain by the grammar alone."""
    engine = llm.engine
    if engine.tokenizer is not None:
        return None
    tok = synthetic_tokenizer.for_model(model)
    if detokenize:
        engine.tokenizer = tok
    else:  # what Engine._grammar builds from a model's own tokenizer
        mc = engine.model_config
        engine._grammars = Grammars.for_tokenizer(tok, mc.vocab_size, list(mc.eos_token_ids))
    return tok


def gpu_idle(timeline: list | None, mixed: bool) -> float:
    """Idle fraction of the decode steps, as tools/bench.py measures it: CUDA events around
    each iteration; the first and last are left out, and so is a gap before an iteration that
    admits a prefill (it holds that prefill, not host idleness). nan without CUDA."""
    tl = (timeline or [])[1:-1]
    if len(tl) < 2:
        return float("nan")
    torch.cuda.synchronize()
    busy = [s.elapsed_time(e) / 1e3 for s, e, admits in tl if not (admits and mixed)]
    gaps = [tl[i][1].elapsed_time(tl[i + 1][0]) / 1e3 for i in range(len(tl) - 1)
            if not tl[i + 1][2]]
    gap = sum(gaps) / max(len(gaps), 1)
    return gap / (sum(busy) / max(len(busy), 1) + gap)


def json_valid(text: str) -> bool:
    """The output parses and follows SCHEMA (jsonschema where installed, else the required
    keys only: the GPU image has no jsonschema). Parsed with strict=False: xgrammar's string
    rule admits raw control characters, which a strict parser refuses."""
    try:
        obj = json.loads(text, strict=False)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(obj, dict) and set(SCHEMA["required"]) <= set(obj)
    try:
        jsonschema.validate(obj, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


def run_mode(llm: LLM, mode: str, prompts: list[list[int]], new: int, repeats: int,
             decode, warmup: bool = True) -> dict:
    """Best of `repeats` timed generates after a warm-up (lazy inits, the grammar compiler);
    GPU idle and grammar_waits from the best one."""
    engine, runner = llm.engine, llm.engine.runner
    params = [mode_params(mode, i, new) for i in range(len(prompts))]
    if warmup:
        llm.generate(prompts, params)
    best = None
    for _ in range(repeats):
        waits = engine.stats.grammar_waits
        runner.timeline = [] if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        timeline, runner.timeline = runner.timeline, None
        tokens = sum(len(o.token_ids) for o in outs)
        if best is None or tokens / dt > best["tokens_per_s"]:
            best = dict(tokens_per_s=tokens / dt, wall_s=dt, output_tokens=tokens,
                        grammar_waits=engine.stats.grammar_waits - waits,
                        gpu_idle_frac=gpu_idle(timeline, runner.mixed), outs=outs)
    outs = best.pop("outs")
    rows = [o for i, o in enumerate(outs) if constrained(mode, i)]
    if rows:  # a grammar row ends at its object's end (stop) or at max_tokens (length)
        texts = [decode(o.token_ids) for o in rows]
        best.update(constrained_rows=len(rows),
                    constrained_tokens_mean=sum(len(o.token_ids) for o in rows) / len(rows),
                    constrained_finished=sum(o.finish_reason == "stop" for o in rows),
                    constrained_valid=sum(map(json_valid, texts)), texts=texts,
                    finish_reasons=[o.finish_reason for o in rows])
    return dict(mode=mode, **best)


def table(rows: list[dict]) -> str:
    plain = next((r["tokens_per_s"] for r in rows if r["mode"] == "plain"), None)
    lines = ["| mode | output tok/s | vs plain | GPU idle | grammar waits | JSON rows done/valid |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / plain:.3f}x" if plain else "-"
        done = (f"{r['constrained_finished']}/{r['constrained_valid']} of "
                f"{r['constrained_rows']}" if "constrained_rows" in r else "-")
        lines.append(f"| {r['mode']} | {r['tokens_per_s']:,.1f} | {ratio} | "
                     f"{100 * r['gpu_idle_frac']:.1f}% | {r['grammar_waits']} | {done} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["plain", "json_all", "json_one", "penalties"],
                    choices=MODES + list(_ALIASES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--sync", action="store_true", help="async_scheduling off (default: on)")
    ap.add_argument("--detokenize", action="store_true",
                    help="presets: stream text in every mode through the synthetic tokenizer")
    ap.add_argument("--out", default=None, help="write sampling_<model>.json here")
    args = ap.parse_args(argv)
    modes = [_ALIASES.get(m, m) for m in args.modes]
    if "plain" in modes:  # the baseline first, so each ratio has it
        modes.remove("plain")
        modes.insert(0, "plain")
    opts = dict(max_batch=args.batch, max_model_len=args.prompt + args.new + 16,
                async_scheduling=not args.sync)
    if args.device:
        opts["device"] = args.device
    llm = LLM(args.model, **opts)
    synthetic = None
    if any(m.startswith("json") for m in modes):
        synthetic = attach_tokenizer(llm, args.model, args.detokenize)
    tok = synthetic or llm.engine.tokenizer
    decode = tok.decode if tok is not None else (lambda ids: "")
    fingerprint = synthetic_tokenizer.fingerprint(synthetic) if synthetic else None
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} on {device}, batch {args.batch}, {args.prompt} + {args.new} tokens, "
          f"{'sync' if args.sync else 'async'}"
          + (f", synthetic tokenizer {fingerprint}" if fingerprint else ""))
    rows = []
    for mode in modes:
        rows.append(run_mode(llm, mode, prompts, args.new, args.repeats, decode))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "texts"}))
    print(table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(model=args.model, device=device, batch=args.batch, prompt=args.prompt,
                    new=args.new, async_scheduling=not args.sync, schema=SCHEMA,
                    synthetic_tokenizer=fingerprint, torch=torch.__version__)
        with open(os.path.join(args.out, f"sampling_{args.model}.json"), "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    llm.close()
    return rows


if __name__ == "__main__":
    main()
