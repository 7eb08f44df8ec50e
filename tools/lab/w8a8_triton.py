"""A candidate for fp8 W8A8 at 17-64 rows: a Triton GEMM of e4m3 rows (already quantized,
kernels/quant_rows_triton.py) by the e4m3 weight on the fp8 tensor cores, K split so that the
4,096-column projections (o, down) fill the GPU, the row and channel scales in the epilogue, the
splits summed in order by linear_triton's split-sum kernel (deterministic).

Why: cuBLASLt picks 128 x 128 tiles at 64 rows, so o and down run on 32 of an H100's 132 SMs
(docs/benchmarks.md). Timed against torch._scaled_mm per llama-8b projection and row count, in a
CUDA graph over enough weight copies that nothing is served from L2:

    python tools/lab/w8a8_triton.py --batches 32 64           # on a GPU: the timing table
    TRITON_INTERPRET=1 python tools/lab/w8a8_triton.py --check  # anywhere: against fp32 sums
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from graphexec.kernels.linear_fp8_rows import quantize_rows, scaled_mm  # noqa: E402
from graphexec.kernels.linear_triton import _split_sum_kernel  # noqa: E402
from graphexec.kernels.quant import quantize_fp8  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """x [M, K] e4m3, xs [M] fp32, w [N, K] e4m3, ws [N] fp32: program (column block, K split)
    over every row (M <= BLOCK_M); out = (x @ w.T) * xs * ws, or its fp32 partial."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter has no fp8 dot
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    acc = acc * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    acc = acc * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    flat = rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if tl.num_programs(1) == 1:
        tl.store(out_ptr + flat, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * M * N + flat, acc, mask=mask)


def linear_w8a8(q: torch.Tensor, scale: torch.Tensor, weight, out_dtype: torch.dtype,
                block_n: int = 64, block_k: int = 128, split: int = 1, stages: int = 4,
                warps: int = 4) -> torch.Tensor:
    """Rows already quantized (q [M, K] e4m3, scale [M, 1]) @ weight.T -> [M, N], M <= 64."""
    m, k = q.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    assert block_m <= 64, "a candidate for decode batches"
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=q.device) if split > 1 else out
    _w8a8_kernel[(triton.cdiv(n, block_n), split)](
        q, scale, weight.data, weight.scale, out, part, m, n, k, k_per_split, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, UPCAST=_INTERPRET, num_warps=warps,
        num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            part, out, out, out, out, out, out, m, n, 0, 0, SPLIT=split, BLOCK=block,
            RES_OUT=False, NORM_OUT=False, PDL=False, PUSH=False, RANK=0, WORLD=1, num_warps=4)
    return out


def check() -> None:
    """Against fp32 sums of the dequantized operands, over row counts, splits and ragged N."""
    dev = "cpu" if _INTERPRET else "cuda"
    g = torch.Generator().manual_seed(0)
    for m, n, k, split in [(5, 40, 256, 1), (17, 72, 512, 2), (33, 64, 384, 3)]:
        x = (torch.randn(m, k, generator=g) * 3).to(dev, torch.bfloat16)
        w = quantize_fp8((torch.randn(n, k, generator=g) * k ** -0.5).to(dev))
        q, s = quantize_rows(x)
        out = linear_w8a8(q, s, w, torch.bfloat16, block_n=32, block_k=64, split=split,
                          stages=2)
        want = (q.float() * s) @ (w.data.float() * w.scale[:, None]).T
        err = (out.float() - want).abs().max().item()
        print(f"m={m} n={n} k={k} split={split}: max |error| {err:.4f} "
              f"(outputs up to {want.abs().max().item():.2f})")
        assert err <= 0.01 * want.abs().max().item() + 1e-3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    if args.check:
        return check()
    from tune_linear import L2_DEFEAT_BYTES, projections, time_graph

    torch.manual_seed(0)
    for name, (n, k) in projections(args.model).items():
        if name == "lm_head":
            continue
        ws = [quantize_fp8(torch.randn(n, k, device="cuda") * k ** -0.5)
              for _ in range(max(1, min(32, math.ceil(L2_DEFEAT_BYTES / (n * k)))))]
        for m in args.batches:
            q, s = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            floor = (n * k + m * k + m * n * 2) / 3.0e12 * 1e6
            base = time_graph(lambda i: scaled_mm(q, s, ws[i], None, torch.bfloat16),
                              len(ws)) * 1e6
            timed = []
            for bn, bk, split, stages, warps in itertools.product(
                    [64, 128], [128, 256], [1, 2, 4, 8], [3, 4], [4]):
                try:
                    us = time_graph(lambda i: linear_w8a8(q, s, ws[i], torch.bfloat16, bn, bk,
                                                          split, stages, warps), len(ws)) * 1e6
                except Exception:  # noqa: BLE001 -- out of resources and the like
                    continue
                timed.append((us, (bn, bk, split, stages, warps)))
            timed.sort()
            best = ", ".join(f"{us:.1f} us {cfg}" for us, cfg in timed[:args.top])
            print(f"{name:8s} M={m:<3d} floor {floor:6.1f} us | scaled_mm {base:6.1f} | "
                  f"triton (block_n, block_k, split, stages, warps): {best}", flush=True)


if __name__ == "__main__":
    main()
