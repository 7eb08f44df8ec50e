"""Runs the async == sync lifecycle state machines under fresh random seeds (CI runs them
derandomized, so the same programs every time). Prints each seed's verdict; a failure prints
Hypothesis's falsifying program, replayable with `--seeds N --shrink`.

    python tools/fuzz_lifecycle.py --machine spec --seeds 0 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from hypothesis import HealthCheck, Phase, seed, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    # graph-shaped: chunked prefill, the async engine's mixed steps padded as CUDA graphs run them
    # constrained: grammar rows (structured outputs) among penalised and plain ones
    ap.add_argument("--machine", choices=["plain", "spec", "graph-shaped", "constrained"],
                    default="plain")
    ap.add_argument("--seeds", type=int, nargs=2, default=[0, 10], metavar=("FIRST", "END"))
    ap.add_argument("--examples", type=int, default=20)
    ap.add_argument("--shrink", action="store_true", help="shrink failures (slow)")
    args = ap.parse_args()
    if args.machine == "spec":
        from test_spec import AsyncEqualsSyncSpeculative as machine
    elif args.machine == "graph-shaped":
        from test_lifecycle_state_machine import GraphShapedAsyncEqualsWholeSync as machine
    elif args.machine == "constrained":
        from test_lifecycle_state_machine import ConstrainedAsyncEqualsSync as machine
    else:
        from test_lifecycle_state_machine import AsyncEqualsSync as machine
    phases = [Phase.generate, Phase.shrink] if args.shrink else [Phase.generate]
    failures = 0
    for s in range(*args.seeds):
        seed(s)(machine)  # run_state_machine_as_test reads the seed from the class
        t0 = time.time()
        try:
            run_state_machine_as_test(machine, settings=settings(
                max_examples=args.examples, stateful_step_count=40, deadline=None,
                database=None, phases=phases, suppress_health_check=list(HealthCheck)))
            print(f"seed {s}: ok ({time.time() - t0:.0f} s)", flush=True)
        except Exception:
            failures += 1
            print(f"seed {s}: FAILED", flush=True)
            traceback.print_exc()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
