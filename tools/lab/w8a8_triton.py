"""Tiles for fp8 W8A8 at decode batches (kernels/linear_w8a8_triton.py, QuantLinearTuning's
w8a8_* fields): every tile and K split against torch._scaled_mm per llama-8b projection and row
count, in a CUDA graph over enough weight copies that nothing is served from L2:

    python tools/lab/w8a8_triton.py --batches 32 64
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec.kernels.linear_fp8_rows import quantize_rows, scaled_mm  # noqa: E402
from graphexec.kernels.linear_w8a8_triton import matmul_rows  # noqa: E402
from graphexec.kernels.quant import quantize_fp8  # noqa: E402
from graphexec.kernels.tuning import DEFAULT  # noqa: E402

def linear_w8a8(q, scale, weight, out_dtype, block_n=64, block_k=256, split=1, stages=4,
                warps=4):
    """The shipped kernel with one tile forced."""
    t = replace(DEFAULT.quant_linear, w8a8_block_n=block_n, w8a8_block_n_wide=block_n,
                w8a8_block_k=block_k, w8a8_stages=stages, w8a8_warps=warps,
                w8a8_few_rows_warps=warps)
    return matmul_rows(q, scale, weight, None, out_dtype, t, split=split)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--block-n", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--block-k", nargs="+", type=int, default=[128, 256])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[3, 4])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    args = ap.parse_args()
    from tune_linear import L2_DEFEAT_BYTES, copy_bandwidth, projections, time_graph

    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    for name, (n, k) in projections(args.model).items():
        if name == "lm_head":
            continue
        ws = [quantize_fp8(torch.randn(n, k, device="cuda") * k ** -0.5)
              for _ in range(max(1, min(32, math.ceil(L2_DEFEAT_BYTES / (n * k)))))]
        for m in args.batches:
            q, s = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            floor = (n * k + m * k + m * n * 2) / bandwidth * 1e6
            base = time_graph(lambda i: scaled_mm(q, s, ws[i], None, torch.bfloat16),
                              len(ws)) * 1e6
            shipped = time_graph(lambda i: matmul_rows(q, s, ws[i], None, torch.bfloat16),
                                 len(ws)) * 1e6
            timed = []
            for bn, bk, split, stages, warps in itertools.product(
                    args.block_n, args.block_k, args.splits, args.stages, args.warps):
                try:
                    us = time_graph(lambda i: linear_w8a8(q, s, ws[i], torch.bfloat16, bn, bk,
                                                          split, stages, warps), len(ws)) * 1e6
                except Exception:  # noqa: BLE001 -- out of resources and the like
                    continue
                timed.append((us, (bn, bk, split, stages, warps)))
            timed.sort()
            best = ", ".join(f"{us:.1f} us {cfg}" for us, cfg in timed[:args.top])
            print(f"{name:8s} M={m:<3d} floor {floor:6.1f} us | scaled_mm {base:6.1f} | "
                  f"shipped {shipped:6.1f} | "
                  f"triton (block_n, block_k, split, stages, warps): {best}", flush=True)


if __name__ == "__main__":
    main()
