"""Device time of the captured wait for grammar masks (kernels/mask_gate_triton.py) with the flag
already up, so the figure is the copy across PCIe and the launch, not the host: for each count
of constrained rows among a batch's rows, one CUDA graph of the pull, replayed many times.

    python tools/lab/time_mask_gate.py --vocab 128256 --rows 64 --constrained 0 1 8 64

Prints one JSON line per count: microseconds per replay and the mask bytes it moved.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from graphexec.capture.mask_gate import MaskGate  # noqa: E402
from graphexec.structured import MASK_ON  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_linear import time_graph  # noqa: E402


def time_pull(vocab: int, rows: int, constrained: int, replays: int) -> dict:
    words = -(-vocab // 64) + 1  # DecodeState.grammar_rows' row: mask words, then the flag
    dev = torch.device("cuda")
    gate = MaskGate(torch.zeros(rows + 1, words, dtype=torch.int64, device=dev),
                    torch.zeros(1, dtype=torch.int64, device=dev),  # no rows in use yet
                    -(-vocab // 32))
    gate.num_rows.fill_(rows)
    gate.host_flags[:] = 0
    gate.host_flags[:constrained] = MASK_ON
    gate.open()  # every ticket is through: only the copy and the launch are timed
    us = time_graph(lambda i: gate.pull(), 1, reps=replays) * 1e6  # pull() waits only captured
    moved = constrained * gate.masks.shape[1] * 4
    return dict(vocab=vocab, rows=rows, constrained=constrained, us_per_pull=round(us, 2),
                mask_bytes=moved, gb_per_s=round(moved / us / 1e3, 2) if moved else None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--constrained", type=int, nargs="+", default=[0, 1, 8, 64])
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args(argv)
    for c in args.constrained:
        if not 0 <= c <= args.rows:
            ap.error(f"--constrained {c}: between 0 and --rows {args.rows}")
        print(json.dumps(time_pull(args.vocab, args.rows, c, args.replays)))


if __name__ == "__main__":
    main()
