"""Time the decode step's attention (rope + K/V write + paged attention in one launch, as the
engine runs it) at the context lengths a serving batch holds, per AttentionTuning variant and
KV cache dtype, inside a CUDA graph over enough layers' caches that nothing is served from L2.

    python tools/lab/time_decode_attention.py --rows 16 46 64 --set decode_fp8_block_n=64 \\
        --set decode_stages=2,decode_fp8_stages=3

Lengths: the offline serving workload's (tools/serve_workload.py): a row is a request part
way through its output, its context the prompt plus a uniform share of the output; or
--context N for every row. Prints, per variant and cache dtype, microseconds a layer and the
KV bytes read over that time.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from graphexec.kernels import attention_decode_triton as at  # noqa: E402
from graphexec.kernels.rope import rope_cos_sin  # noqa: E402
from graphexec.kernels.tuning import DEFAULT  # noqa: E402
from serve_workload import WorkloadConfig  # noqa: E402
from tune_linear import time_graph  # noqa: E402

HQ, HK, D, BS, MAX_LEN = 32, 8, 128, 16, 4096  # llama-8b heads; the engine's defaults


def serving_lengths(rows: int, seed: int) -> np.ndarray:
    cfg = WorkloadConfig()
    rng = np.random.default_rng(seed)
    prompt = cfg.prompt.sample(rng, rows)
    output = cfg.output.sample(rng, rows)
    return np.minimum(prompt + (rng.random(rows) * output).astype(np.int64) + 1, MAX_LEN)


def layer_inputs(lengths: np.ndarray, kv_dtype: torch.dtype, layers: int):
    """Per layer: the cache pair, and the step's shared q, new k / v, tables and slots."""
    b = len(lengths)
    blocks = [(int(n) + BS - 1) // BS for n in lengths]
    total = sum(blocks) + 1
    perm = torch.randperm(total - 1, device="cuda").int()
    tables = torch.full((b, MAX_LEN // BS), total - 1, dtype=torch.int32, device="cuda")
    at_block = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[at_block:at_block + nb]
        at_block += nb
    caches = [(torch.randn(total, BS, HK, D, device="cuda").to(kv_dtype),
               torch.randn(total, BS, HK, D, device="cuda").to(kv_dtype)) for _ in range(layers)]
    sl = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    pos = (sl - 1).long()
    slots = tables.gather(1, (pos // BS)[:, None]).long()[:, 0] * BS + pos % BS
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(b, HK, D, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(b, HK, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(MAX_LEN, D, 500000.0, device="cuda")
    return caches, (q, kn, vn, pos, cos, sin, tables, sl, slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[46])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=None,
                    help="every row at this many tokens instead of serving's lengths")
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--set", action="append", default=[], metavar="K=V[,K=V]",
                    help="one variant: AttentionTuning entries (the shipped table is first)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    variants = [{}] + [dict((kv.split("=")[0], ast.literal_eval(kv.split("=")[1]))
                            for kv in item.split(",")) for item in args.set]
    print(torch.cuda.get_device_name())
    for rows in args.rows:
        lengths = (serving_lengths(rows, args.seed) if args.context is None
                   else np.full(rows, args.context, dtype=np.int64))
        print(f"rows {rows}: context mean {lengths.mean():.0f}, median "
              f"{np.median(lengths):.0f}, max {lengths.max()}")
        for kv in args.kv:
            dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
            caches, (q, kn, vn, pos, cos, sin, tables, sl, slots) = layer_inputs(
                lengths, dtype, layers=max(2, int(400e6 // (2 * lengths.sum() * HK * D))))
            kv_bytes = 2 * int(lengths.sum()) * HK * D * caches[0][0].element_size()
            for var in variants:
                tuning = dataclasses.replace(DEFAULT.attention, **var)

                def step(i, tuning=tuning):
                    k, v = caches[i]
                    at.rope_decode_attention(q, kn, vn, pos, cos, sin, k, v, slots, tables, sl,
                                             D ** -0.5, tuning=tuning)
                try:
                    us = time_graph(step, len(caches)) * 1e6
                except Exception as e:  # out of resources and the like
                    print(f"  {kv:4s} {var or 'shipped'}: {type(e).__name__}")
                    continue
                print(f"  {kv:4s} {us:7.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s  "
                      f"{var or 'shipped'}", flush=True)
            del caches
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
