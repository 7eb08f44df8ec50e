"""Time fp8 weights at many rows on an H100: W8A16 (kernels/linear_quant_triton.py, or the dense
copy above QuantLinearTuning.max_rows) against W8A8 on torch._scaled_mm (the GEMM alone, the
activations already in fp8 as a fused producer would leave them; and with fast accumulation),
bf16 cuBLAS beside them, per llama-8b projection and row count, in a CUDA graph over enough
weight copies that nothing is served from L2.

    python tools/lab/time_fp8_w8a8.py --batches 16 32 64 128 512 2048
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec.kernels import linear_quant_triton as lq  # noqa: E402
from graphexec.kernels.linear_fp8_rows import quantize_rows  # noqa: E402
from graphexec.kernels.quant import dequantize, quantize_fp8  # noqa: E402
from tune_linear import L2_DEFEAT_BYTES, copy_bandwidth, projections, time_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 32, 64, 128, 512, 2048])
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    for name, (n, k) in projections(args.model).items():
        if name == "lm_head":
            continue
        qs = [quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)]
        copies = max(1, min(32, math.ceil(L2_DEFEAT_BYTES / qs[0].nbytes)))
        qs += [quantize_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5)
               for _ in range(copies - 1)]
        dense = [dequantize(q) for q in qs[:max(1, math.ceil(L2_DEFEAT_BYTES / (n * k * 2)))]]
        wt = [q.data.t() for q in qs]
        sb = [q.scale[None, :] for q in qs]
        for m in args.batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            floor = (qs[0].nbytes + m * (k + n) * 2) / bw * 1e6
            t = dict(
                bf16=time_graph(lambda i: F.linear(x, dense[i % len(dense)]), copies),
                w8a16=time_graph(lambda i: lq.linear_quant(x, qs[i]), copies),
                mm=time_graph(lambda i: torch._scaled_mm(xq, wt[i], scale_a=xs, scale_b=sb[i],
                                                         out_dtype=torch.bfloat16), copies),
                mm_fast=time_graph(lambda i: torch._scaled_mm(
                    xq, wt[i], scale_a=xs, scale_b=sb[i], out_dtype=torch.bfloat16,
                    use_fast_accum=True), copies),
                quant_torch=time_graph(lambda i: quantize_rows(x), copies))
            print(f"{name:8s} M={m:<5d} floor {floor:7.1f} us | " + " | ".join(
                f"{key} {v * 1e6:7.1f} ({floor / (v * 1e6):.2f})" for key, v in t.items()),
                flush=True)
        del qs, dense, wt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
