"""Random JSON-schema, regex and choice requests at temperature 1 among unconstrained ones,
through one engine: counts grammar violations (a token the matcher refused, an output that ends
by EOS but does not parse, validate or fullmatch). Exits 1 on any violation.

    python tools/fuzz_structured.py --requests 2000 --device cuda            # async, graphs
    python tools/fuzz_structured.py --requests 200 --device cpu --sync
    python tools/fuzz_structured.py --requests 2000 --device cuda --spec self:15 --k 3
    python tools/fuzz_structured.py --model llama-1b --synthetic-tokenizer --device cuda

A preset ships no tokenizer: --synthetic-tokenizer gives it one trained to its vocabulary
(tools/synthetic_tokenizer.py), for a GPU machine that has no model files.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphexec import Engine, SpeculativeConfig  # noqa: E402
from test_structured_outputs import MODEL, _requests, check_output  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--sync", action="store_true", help="sync scheduling (default async)")
    ap.add_argument("--spec", default=None,
                    help="speculative decoding with this draft (self:N, a preset, a directory)")
    ap.add_argument("--k", type=int, default=3, help="with --spec: tokens drafted per step")
    ap.add_argument("--synthetic-tokenizer", action="store_true",
                    help="a preset model: encode, decode and compile grammars with a BPE "
                         "trained to its vocabulary")
    args = ap.parse_args()
    opts = dict(max_model_len=512, max_batch=args.batch, async_scheduling=not args.sync)
    if args.spec:
        opts["speculative"] = SpeculativeConfig(args.spec, args.k)
    if args.device:
        opts["device"] = args.device
    engine = Engine(args.model, **opts)
    if args.synthetic_tokenizer:
        import synthetic_tokenizer

        engine.tokenizer = synthetic_tokenizer.for_model(args.model)
    eos = engine.model_config.eos_token_ids
    reqs = _requests(args.requests, seed=args.seed)
    checks = {rid: (sp, check) for rid, _, sp, check in reqs}
    t0 = time.perf_counter()
    for rid, prompt, sp, _ in reqs:
        engine.add_request(rid, prompt, sp)
    grammars = {rid: engine.requests[rid].grammar for rid in checks}
    complete = violations = 0
    while engine.has_unfinished():
        for out in engine.step():
            if not out.finished:
                continue
            sp, check = checks[out.request_id]
            g = grammars[out.request_id]
            try:
                assert g is None or g.rejected == 0, f"{g.rejected} tokens refused"
                assert g is None or out.num_drafted_tokens == 0, "a grammar row drafted"
                complete += check_output(out, sp, check, eos)
            except Exception as e:  # noqa: BLE001 -- every violation is counted and shown
                violations += 1
                print(f"VIOLATION {out.request_id}: {e!r} {out.text!r}")
    dt = time.perf_counter() - t0
    constrained = sum(c is not None for _, c in checks.values())
    print(f"{args.requests} requests ({constrained} constrained, {complete} complete and "
          f"checked) in {dt:.1f} s, {'sync' if args.sync else 'async'}: {violations} violations; "
          f"grammar waits {engine.stats.grammar_waits} of {engine.stats.steps} steps")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
