"""Launch configs of the fused tensor-core projections (kernels/op_sets.py, FusedOps) on a GPU,
against the unfused cuBLAS path they replace, on a model's layer shapes: every projection of 16
layers with their own weights (so nothing is served from L2) replayed from one CUDA graph, the
way the decode step chains them.

    python tools/lab/tune_fused.py --model llama-1b --batches 16 64
    python tools/lab/tune_fused.py --model llama-8b --tp 2 --batches 64   # one rank's shapes

Per kind (o and down with the residual in their epilogue, gate_up with silu * mul in its, qkv
plain) the candidate configs in microseconds per layer, against the cuBLAS kernels they
replace; then a layer's whole projection chain, fused (best configs; qkv on cuBLAS or Triton,
projections as programmatic dependents or not) against cuBLAS with its separate add + RMSNorm
and silu * mul kernels. Writes tune_fused.json to --out.
pick_fused_config's table (kernels/tuning.py, LinearTuning) is to be set from these runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graphexec.kernels import activation_triton as at  # noqa: E402
from graphexec.kernels import linear_fused_triton as lf  # noqa: E402
from graphexec.kernels import linear_triton as lt  # noqa: E402
from graphexec.kernels import norm_rope_triton as nr  # noqa: E402
from graphexec.kernels import pdl  # noqa: E402
from tune_linear import SHAPES, time_graph  # noqa: E402

LAYERS = 16


def candidates(m: int, kind: str, wide: bool = False) -> list[lt.LinearConfig]:
    """wide: also column tiles of 128-256 (so fewer programs re-read the rows from L2), K split
    up to 16 ways (qkv too), and eight warps for the wide tiles."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    add = kind.startswith("add")
    splittable = add or (wide and kind in ("qkv", "lm_head"))
    block_ns = [16, 32, 64] + ([128, 256] if wide else [])
    splits = ([1, 2, 4] + ([8, 16] if wide else [])) if splittable else [1]
    out = []
    for bn, bk, split, stages, warps in itertools.product(
            block_ns, [128] if add or wide and kind == "qkv" else [64, 128], splits,
            [3, 4] if wide else [4, 5],
            [4, 8] if wide else [4]):
        if kind == "silu" and (bn == 16 or bk == 128 and bn < 64):
            continue  # two accumulators: wide tiles spill, narrow ones did not pay (at 1309bc7)
        if warps == 8 and bn < 128 and kind != "silu" or wide and split > 1 and bn < 32:
            continue
        if kind == "lm_head" and (bn < 32 or split > 1):
            continue  # 4008 programs at 32 columns already
        out.append(lt.LinearConfig(block_m, bn, bk, split, num_warps=warps, num_stages=stages))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batches", nargs="+", type=int, default=[64])
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--wide", action="store_true",
                    help="wider tiles, deeper splits, 8 warps, and the LM head (see candidates)")
    ap.add_argument("--l2-mib", nargs="*", type=float, default=[1, 2, 4],
                    help="the chain again with L2 prefetch of the next weight, these MiB")
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="only these kinds (qkv add_o silu add_down, lm_head with --wide)")
    ap.add_argument("--tp", type=int, default=1,
                    help="the shapes one rank of this tensor_parallel_size runs")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    h, qkv_n, inter, vocab = SHAPES[args.model]
    # one rank's shapes (model/shard.py): o's and down's inputs split, qkv and gate_up outputs
    att_k, qkv_n = h // args.tp, qkv_n // args.tp
    inter, vocab = inter // args.tp, vocab // args.tp
    dt, dev = torch.bfloat16, "cuda"
    rnd = lambda *s: torch.randn(*s, dtype=dt, device=dev) * s[-1] ** -0.5
    w = [dict(qkv=rnd(qkv_n, h), o=rnd(h, att_k), gate_up=rnd(2 * inter, h), down=rnd(h, inter),
              n1=torch.ones(h, dtype=dt, device=dev), n2=torch.ones(h, dtype=dt, device=dev))
         for _ in range(LAYERS)]
    results = []
    for m in args.batches:
        x, res = rnd(m, h), rnd(m, h)
        att, act = rnd(m, att_k), rnd(m, inter)
        ops = {  # kind -> fn(layer, config)
            "qkv": lambda i, c: lt.linear(x, w[i]["qkv"], config=c),
            "add_o": lambda i, c: lf.linear_add(att, w[i]["o"], res, config=c),
            "silu": lambda i, c: lf.linear_silu(x, w[i]["gate_up"], config=c),
            "add_down": lambda i, c: lf.linear_add(act, w[i]["down"], res, config=c),
        }
        cublas = {  # what each replaces
            "qkv": lambda i: F.linear(x, w[i]["qkv"]),
            "add_o": lambda i: F.linear(att, w[i]["o"]),
            "silu": lambda i: at.silu_mul(F.linear(x, w[i]["gate_up"])),
            "add_down": lambda i: F.linear(act, w[i]["down"]),
        }
        if args.wide:  # two copies of the (L2-defeating) vocabulary projection
            heads = [rnd(vocab, h) for _ in range(2)]
            ops["lm_head"] = lambda i, c: lt.linear(x, heads[i % 2], config=c)
            cublas["lm_head"] = lambda i: F.linear(x, heads[i % 2])
        best = {}
        for kind, fn in ops.items():
            if args.kinds and kind not in args.kinds:
                continue
            base = time_graph(cublas[kind], LAYERS) * 1e6
            timed = []
            for cfg in candidates(m, kind, args.wide):
                try:
                    timed.append((time_graph(lambda i: fn(i, cfg), LAYERS) * 1e6, cfg))
                except Exception as e:  # out of shared memory / registers: not a candidate
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
            timed.sort(key=lambda t: t[0])
            best[kind] = timed[0][1]
            row = dict(m=m, kind=kind, cublas_us=round(base, 2),
                       top=[dict(us=round(t, 2), config=vars(c)) for t, c in timed[:args.top]])
            results.append(row)
            print(json.dumps(row), flush=True)

        def fused_chain(i, qkv_triton, l2=0):
            # kernels/l2_prefetch.py: each projection warms L2 with the next one's weight
            nxt = lambda name: dict(prefetch=w[i][name] if l2 else None, prefetch_bytes=l2)
            n1 = nr.rms_norm(x, w[i]["n1"], 1e-5)
            if qkv_triton:
                lt.linear(n1, w[i]["qkv"], config=best["qkv"], **nxt("o"))
            else:
                F.linear(n1, w[i]["qkv"])
            s1 = lf.linear_add(att, w[i]["o"], res, config=best["add_o"], **nxt("gate_up"))
            a = lf.linear_silu(nr.rms_norm(s1, w[i]["n2"], 1e-5), w[i]["gate_up"],
                               config=best["silu"], **nxt("down"))
            return lf.linear_add(a, w[i]["down"], s1, config=best["add_down"],
                                 prefetch=w[(i + 1) % LAYERS]["qkv"], prefetch_bytes=l2)

        def cublas_chain(i):
            n1, s0 = nr.add_rms_norm(x, res, w[i]["n1"], 1e-5)
            F.linear(n1, w[i]["qkv"])
            o = F.linear(att, w[i]["o"])
            n2, s1 = nr.add_rms_norm(o, s0, w[i]["n2"], 1e-5)
            return F.linear(at.silu_mul(F.linear(n2, w[i]["gate_up"])), w[i]["down"])

        if len(best) < 4:  # --kinds left some out
            continue
        chain = dict(m=m, kind="layer chain", cublas_us=round(time_graph(cublas_chain, LAYERS)
                                                             * 1e6, 2),
                     configs={k: vars(c) for k, c in best.items()})
        shipped_mode = pdl.mode
        for mode in (shipped_mode, "off"):  # programmatic dependents (GRAPHEXEC_PDL), or not
            pdl.mode = mode
            for qkv_triton in (0, 1):
                fn = lambda i: fused_chain(i, qkv_triton)
                key = f"fused_qkv{'triton' if qkv_triton else 'cublas'}_pdl{int(mode != 'off')}_us"
                chain[key] = round(time_graph(fn, LAYERS) * 1e6, 2)
        pdl.mode = shipped_mode
        for mib in args.l2_mib:  # each projection warming L2 with the next one's weight
            chain[f"fused_qkvtriton_pdl1_l2_{mib}mib_us"] = round(
                time_graph(lambda i: fused_chain(i, 1, l2=int(mib * 2**20)), LAYERS) * 1e6, 2)
        results.append(chain)
        print(json.dumps(chain), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_fused.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
