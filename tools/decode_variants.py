"""Decode step time under alternative kernel choices, each run in its own process (a choice
changes compiled kernels, and the overlap of programmatic dependent launch only shows inside a
real decode step, which tools/tune_linear.py, timing projections one at a time, cannot see).

`python tools/decode_variants.py VARIANT [--model llama-1b] [--batch 1]`

One-row projection configs (kernels/linear_triton.py, M = 1; other row counts keep pick_config):
  shipped     everything as it is
  plain4x2048 the projections without a fused norm 4 columns x 2048-wide K steps: the rule
              before 8 x 1024 (2026-11-26)
  k512        4 columns x 512-wide K steps (1024 for K >= 8192), fused norm 8 x 1024: the rule
              before 2048-wide steps
  k2048w8     4 x 2048 everywhere (down included), fused norm 4 x 2048, 8 warps
  down1024    shipped, but the down projection (K = 8192) 1024 wide (the rule before commit
              "down projection 2048 wide": 1.112 ms a step against 1.063 on llama-1b)
  norm2048    shipped, but the fused-norm projections 8 x 2048 (4 warps)
  norm4x2048  shipped, but the fused-norm projections 4 x 2048 (4 warps)
Who runs the projections above one row (the default "auto": cuBLAS; run these at --batch 64):
  down-triton      the down projection on Triton up to 64 rows (tune_linear: 17.0 vs 17.4 us
                   for cuBLAS's split-K and its reduce kernel at 64 rows)
  lmhead-triton    the LM head (any weight of >= 65536 rows) on Triton up to 64 rows (188 vs
                   196.5 us), after the separate norm kernel
  both-triton      the two together
  auto-rows1, auto-rows8
                   "auto" with Triton for every projection up to 1 / 8 rows (a batch-1
                   speculative verify of K = 4 has 5)
The changes of commit 82d61d2, each undone alone (compare with shipped in the same run on the
same machine), and all together:
  two-pass    the fused norm's mean-square pass before the loop (NORM_ONE_PASS = False)
  final-norm-separate
              the final add + RMSNorm as its own kernel before the LM head (one-row batches)
  no-prefetch the fused attention waits before it reads anything (DECODE_TUNING prefetch 0)
  prefetch-all
              the fused attention prefetches at every batch size (shipped: up to
              PREFETCH_MAX_ROWS rows)
  tail-not-dependent
              the kernels after the LM head (stop-token mask, sampling, advance) launch
              normally, not as programmatic dependents (pdl.TAIL = False)
  undo-82d61d2
              the four together: the decode step as commit d1e2686 had it, but for the
              sampled tokens' copy, which the advance kernel now does
  lmhead-cublas
              the LM head on cuBLAS from 2 rows (shipped: Triton up to WIDE_MAX_ROWS rows)
  small-o, small-o-lmhead, small-o-lmhead-qkv, small-o-lmhead-qkv-down
              2-16 rows: those projections on the shipped tensor-core Triton configs (with
              programmatic dependent launch), the others on cuBLAS (run with --spec, and at
              --batch 4 / 16)
  lmhead64    2-64 rows: the LM head on Triton after the norm kernel
  small-qkv-fused, small-o-qkv-fused
              2-16 rows: the qkv projection with the one-pass norm in its prologue on the
              tensor-core Triton config (and o on Triton)
  attn-block16, attn-block32, attn-block64
              decode attention tiles of 16 / 32 / 64 keys at every batch size (shipped: 32 up to
              SHORT_TILE_MAX_ROWS rows for head dims <= 64, else 64)
  fused-norm64
              qkv, gate_up and the LM head as Triton projections with the one-pass norm fused
              in up to 64 rows (run at --batch 64; "auto" runs the norm, then cuBLAS)
  unfused     no epilogue-fused projections (the default before commit 1309bc7)
  fused       triton_ops.fused_ops over "auto" for --fused-rows (default 2..64): o and down
              with the residual add in their epilogue, gate_up with silu * mul in its;
              --fused-config KIND=BM,BN,BK,SPLIT,WARPS,STAGES (KIND gate_up, qkv, add, or
              o / down for one of the two) overrides pick_fused_config, with any variant
  cublaslt    every cuBLAS projection through cuBLASLt (torch's preferred_blas_library)
  attn-splits2, attn-splits3
              decode attention with 2 / 3 context splits per row at every batch size
  no-prenorm  no norm begun in the epilogue of o and down (triton_ops.PRENORM = False): the
              norm kernels between them and gate_up / qkv at 33-64 rows, as before commit cf8b75c
  lmhead-cublas64
              the LM head of 33-64-row batches on cuBLAS after the norm kernel (shipped: the
              tensor-core Triton kernel, triton_ops.FUSED_LM_HEAD; --fused-config lm_head=...
              picks its tile)
  d2h-copy    decode tokens reach the host through a D2H copy after each replay, not through
              the pinned mailbox the iteration's last kernel writes (runner.ZERO_COPY_RESULTS)
  d2h-copy-lmhead-cublas64
              d2h-copy and lmhead-cublas64 together: the step as commit 275f4cb had it
  no-l2-prefetch
              the fused projections do not warm L2 with the next projection's weight
              (--l2 sets how much they do, by kind)
  no-norms-timing
              TIMING ONLY, wrong outputs: every RMSNorm kernel of a 33-64 row batch skipped
              (the input passed on as if normed): what removing them could save at most
Decode attention:
  min-tiles1, min-tiles2, min-tiles4, min-tiles8
                   a row takes one more split per this many 64-key tiles of its context (up to
                   the split count the grid has); the default is MIN_TILES_PER_SPLIT
  merge-in-kernel, merge-reduce
                   a row's splits merged by the split kernel's last program, or by a second
                   launch; the default is MERGE_IN_KERNEL
Prints one JSON line: decode step ms, GPU busy ms, roofline fraction, idle fraction.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import bench_graphexec, copy_bandwidth  # noqa: E402
from graphexec.kernels import linear_fused_triton as lf  # noqa: E402
from graphexec.kernels import linear_triton as lt  # noqa: E402


def _one_row_rule(block_k: int, long_block_k: int, warps: int, norm_cols: int,
                  norm_block_k: int, cols: int = 4):
    shipped, shipped_norm = lt.pick_config, lt.pick_norm_config

    def pick(m, n, k):
        if m != 1:
            return shipped(m, n, k)
        return lt.LinearConfig(1, cols, long_block_k if k >= 8192 else block_k,
                               num_warps=warps)

    def pick_norm(m, n, k):
        if m != 1:
            return shipped_norm(m, n, k)
        return lt.LinearConfig(1, norm_cols, norm_block_k, num_warps=warps)
    return pick, pick_norm


def _auto_with(down: bool, lm_head: bool):
    """The "auto" op set with the down projection and/or the LM head on Triton up to 64 rows."""
    from dataclasses import replace
    from functools import partial

    from graphexec.kernels import triton_ops

    auto = triton_ops.TRITON_SINGLE_ROW_OPS
    ops = auto
    if down:
        ops = replace(ops, silu_mul_linear=partial(lt.silu_mul_linear, max_rows=lt.MAX_ROWS))
    if lm_head:  # the LM head is the model's only norm_linear over >= 65536 rows
        def norm_linear(x, residual, norm_weight, eps, weight, bias=None):
            if weight.shape[0] >= 65536:
                return lt.norm_linear(x, residual, norm_weight, eps, weight, bias,
                                      max_rows=lt.MAX_ROWS)
            return auto.norm_linear(x, residual, norm_weight, eps, weight, bias)
        ops = replace(ops, norm_linear=norm_linear)
    triton_ops.TRITON_SINGLE_ROW_OPS = ops  # select_ops reads it when the engine starts


VARIANTS = {
    "shipped": None,
    "k512": lambda: _one_row_rule(512, 1024, 4, 8, 1024),
    "plain4x2048": lambda: _one_row_rule(2048, 2048, 4, 8, 1024),
    "k2048w8": lambda: _one_row_rule(2048, 2048, 8, 4, 2048),
    "down1024": lambda: _one_row_rule(2048, 1024, 4, 8, 1024),
    "norm2048": lambda: _one_row_rule(2048, 1024, 4, 8, 2048),
    "norm4x2048": lambda: _one_row_rule(2048, 1024, 4, 4, 2048),
    "down-triton": lambda: _auto_with(down=True, lm_head=False),
    "lmhead-triton": lambda: _auto_with(down=False, lm_head=True),
    "both-triton": lambda: _auto_with(down=True, lm_head=True),
    "auto-rows1": lambda: _auto_rows(1),
    "auto-rows8": lambda: _auto_rows(8),
}
OP_SET_VARIANTS = {"down-triton", "lmhead-triton", "both-triton", "auto-rows1", "auto-rows8"}


def _two_pass() -> None:
    lt.NORM_ONE_PASS = False


def _final_norm_separate() -> None:
    """The LM head (any weight of >= 65536 rows) gets an already normed input."""
    from dataclasses import replace

    from graphexec.kernels import triton_ops

    auto = triton_ops.TRITON_SINGLE_ROW_OPS

    def norm_linear(x, residual, norm_weight, eps, weight, bias=None):
        if weight.shape[0] < 65536:
            return auto.norm_linear(x, residual, norm_weight, eps, weight, bias)
        normed, summed = lt._norm(x, residual, norm_weight, eps)
        return auto.linear(normed, weight, bias), summed
    triton_ops.TRITON_SINGLE_ROW_OPS = replace(auto, norm_linear=norm_linear)


def _fused_norm_rows(rows: int) -> None:
    """Every norm + projection (qkv, gate_up, the LM head) as one Triton kernel with the
    one-pass norm up to `rows` rows; the other projections stay "auto"."""
    from dataclasses import replace

    from graphexec.kernels import triton_ops

    lt.FUSE_MAX_ROWS = rows
    triton_ops.TRITON_SINGLE_ROW_OPS = replace(
        triton_ops.TRITON_SINGLE_ROW_OPS, norm_linear=partial(lt.norm_linear, max_rows=rows))


def _set_tuning(key: str, value: int) -> None:
    from graphexec.kernels import attention_triton
    attention_triton.DECODE_TUNING[key] = value


def _no_prefetch() -> None:
    _set_tuning("prefetch", 0)


def _tail_not_dependent() -> None:
    from graphexec.kernels import pdl
    pdl.TAIL = False


def _attention_block_n(n: int) -> None:
    from graphexec.kernels import attention_triton
    attention_triton.DECODE_TUNING["block_n"] = n


def _undo_82d61d2() -> None:
    _two_pass()
    _final_norm_separate()
    _no_prefetch()
    _tail_not_dependent()


def _small_rows_triton(which: str, max_rows: int = 16) -> None:
    """2..max_rows rows: the projections named in `which` (o: the square weights; lm_head:
    weights of >= 65536 rows, after the separate norm; qkv; down) on the shipped tensor-core
    Triton configs, the others as shipped (tune_linear, llama-8b at 5 rows: Triton o 16.1 vs
    cuBLAS 16.6 us, LM head 347.5 vs 375.5, gate_up 89.5 vs 82.6)."""
    from dataclasses import replace

    from graphexec.kernels import triton_ops

    auto = triton_ops.TRITON_SINGLE_ROW_OPS
    names = set(which.split("+"))

    def small(x):
        return 1 < x.shape[0] <= max_rows

    def linear(x, weight, bias=None):
        if small(x) and "o" in names and weight.shape[0] == weight.shape[1]:
            return lt.linear(x, weight, bias, max_rows=max_rows)
        return auto.linear(x, weight, bias)

    def norm_linear(x, residual, norm_weight, eps, weight, bias=None):
        wide = weight.shape[0] >= 65536
        qkv = not wide and weight.shape[0] < 4 * x.shape[1]  # gate_up is 2 x intermediate
        if small(x) and "qkv-fused" in names and qkv:  # the one-pass norm in the prologue
            return lt.norm_linear(x, residual, norm_weight, eps, weight, bias,
                                  config=lt.pick_config(x.shape[0], *weight.shape),
                                  max_rows=max_rows)
        if small(x) and (("lm_head" in names and wide) or ("qkv" in names and qkv)):
            normed, summed = lt._norm(x, residual, norm_weight, eps)
            return lt.linear(normed, weight, bias, max_rows=max_rows), summed
        return auto.norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(gate_up, weight, bias=None):
        if small(gate_up) and "down" in names:
            return lt.silu_mul_linear(gate_up, weight, bias, max_rows=max_rows)
        return auto.silu_mul_linear(gate_up, weight, bias)
    triton_ops.TRITON_SINGLE_ROW_OPS = replace(auto, linear=linear, norm_linear=norm_linear,
                                               silu_mul_linear=silu_mul_linear)


def _fused(rows: str, configs: list[str]) -> None:
    from graphexec.kernels import triton_ops

    lo, hi = (int(v) for v in rows.split(","))
    triton_ops.TRITON_SINGLE_ROW_OPS = triton_ops.fused_ops(
        triton_ops.auto_ops(triton_ops.AUTO_MAX_ROWS), lo, hi)
    _fused_configs(configs)


def _fused_configs(configs: list[str]) -> None:
    for spec in configs:
        kind, values = spec.split("=")
        bm, bn, bk, split, warps, stages = (int(v) for v in values.split(","))
        lf.FUSED_TUNING[kind] = lt.LinearConfig(bm, bn, bk, split, warps, stages)


def _lm_head_cublas() -> None:
    from graphexec.kernels import triton_ops
    triton_ops.WIDE_MAX_ROWS = triton_ops.AUTO_MAX_ROWS


def _lm_head_cublas64() -> None:
    from graphexec.kernels import triton_ops
    triton_ops.FUSED_LM_HEAD = False


def _d2h_copy() -> None:
    from graphexec import runner
    runner.ZERO_COPY_RESULTS = False


def _cublaslt() -> None:
    import torch
    torch.backends.cuda.preferred_blas_library("cublaslt")


def _no_prenorm() -> None:
    from graphexec.kernels import triton_ops
    triton_ops.PRENORM = False


def _no_l2_prefetch() -> None:
    from graphexec.kernels import triton_ops
    triton_ops.L2_PREFETCH_BYTES.clear()


def _no_norms_timing() -> None:
    shipped = lt._norm

    def skip(x, residual, norm_weight, eps):
        if residual is None and 33 <= x.shape[0] <= 64:
            return x, x
        return shipped(x, residual, norm_weight, eps)
    lt._norm = skip


def _attention_splits(n: int) -> None:
    from graphexec.kernels import attention_triton
    attention_triton._decode_num_splits = lambda *args: n


STEP_VARIANTS = {"cublaslt": _cublaslt,
                 "attn-splits2": partial(_attention_splits, 2),
                 "attn-splits3": partial(_attention_splits, 3),
                 "two-pass": _two_pass, "final-norm-separate": _final_norm_separate,
                 "no-prefetch": _no_prefetch, "undo-82d61d2": _undo_82d61d2,
                 "prefetch-all": partial(_set_tuning, "prefetch", 1),
                 "tail-not-dependent": _tail_not_dependent,
                 "attn-block16": partial(_attention_block_n, 16),
                 "attn-block32": partial(_attention_block_n, 32),
                 "attn-block64": partial(_attention_block_n, 64),
                 "fused-norm64": partial(_fused_norm_rows, 64),
                 "lmhead-cublas": _lm_head_cublas,
                 "small-o": partial(_small_rows_triton, "o"),
                 "small-o-lmhead": partial(_small_rows_triton, "o+lm_head"),
                 "small-o-lmhead-qkv": partial(_small_rows_triton, "o+lm_head+qkv"),
                 "small-qkv-fused": partial(_small_rows_triton, "qkv-fused"),
                 "lmhead64": partial(_small_rows_triton, "lm_head", 64),
                 "small-o-qkv-fused": partial(_small_rows_triton, "o+qkv-fused"),
                 "small-o-lmhead-qkv-down": partial(_small_rows_triton,
                                                    "o+lm_head+qkv+down"),
                 "no-norms-timing": _no_norms_timing, "no-prenorm": _no_prenorm,
                 "no-l2-prefetch": _no_l2_prefetch, "lmhead-cublas64": _lm_head_cublas64,
                 "d2h-copy": _d2h_copy}


def _auto_rows(max_rows: int) -> None:
    from graphexec.kernels import triton_ops
    triton_ops.TRITON_SINGLE_ROW_OPS = triton_ops.auto_ops(max_rows)


def _min_tiles(n: int):
    from graphexec.kernels import attention_triton
    attention_triton.MIN_TILES_PER_SPLIT = n


def _merge(in_kernel: bool):
    from graphexec.kernels import attention_triton
    attention_triton.DECODE_TUNING["merge"] = int(in_kernel)


# Decode attention (kernels/attention_triton.py): the fewest 64-key tiles a split takes, and
# where a row's splits are merged
ATTENTION_VARIANTS = {f"min-tiles{n}": partial(_min_tiles, n) for n in (1, 2, 4, 8)}
ATTENTION_VARIANTS.update({"merge-in-kernel": partial(_merge, True),
                           "merge-reduce": partial(_merge, False)})


def _override_one_row(m1: str | None, m1_norm: str | None, only_n: int | None = None) -> None:
    """--m1 / --m1-norm: a one-row config given on the command line (cols, block_k, warps),
    for every weight or (--only-n) the weights of that many rows."""
    def parse(spec):
        cols, block_k, warps = (int(v) for v in spec.split(","))
        return lt.LinearConfig(1, cols, block_k, num_warps=warps)

    def pick(m, n, k, c, f):
        return c if m == 1 and only_n in (None, n) else f(m, n, k)

    for spec, attr in ((m1, "pick_config"), (m1_norm, "pick_norm_config")):
        if spec is None:
            continue
        config, inner = parse(spec), getattr(lt, attr)
        setattr(lt, attr, partial(pick, c=config, f=inner))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant",
                    choices=list(VARIANTS) + list(ATTENTION_VARIANTS) + list(STEP_VARIANTS)
                    + ["fused", "unfused", "d2h-copy-lmhead-cublas64"])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--projections", default="auto")
    ap.add_argument("--m1", default=None, metavar="COLS,BLOCK_K,WARPS",
                    help="one-row projection config for every weight (overrides the variant's)")
    ap.add_argument("--m1-norm", default=None, metavar="COLS,BLOCK_K,WARPS",
                    help="one-row config of the projections with the norm fused in")
    ap.add_argument("--only-n", type=int, default=None, metavar="N",
                    help="--m1 / --m1-norm only for weights of N rows (llama-1b: qkv 3072, "
                         "gate_up 16384, LM head 128256)")
    ap.add_argument("--spec", action="store_true",
                    help="instead of plain decode: tools/bench_spec.py's damped self:4 K=4 "
                         "set-up (llama-8b) at --batch, sync and async, against plain decode")
    ap.add_argument("--fused-rows", default="2,64", metavar="MIN,MAX")
    ap.add_argument("--fused-config", action="append", default=[],
                    metavar="KIND=BM,BN,BK,SPLIT,WARPS,STAGES")
    ap.add_argument("--fused-qkv", choices=["triton", "cublas"], default=None,
                    help="fused: the qkv projection on Triton or cuBLAS whatever its size "
                         "(default: triton_ops.FUSED_QKV_TRITON_MAX_ELEMENTS decides)")
    ap.add_argument("--attn", default=None, metavar="KEY=V[,KEY=V]",
                    help="decode attention launch knobs (attention_triton.DECODE_TUNING): "
                         "block_n, num_warps, num_stages, merge, prefetch, num_splits")
    ap.add_argument("--pdl-max-rows", type=int, default=None,
                    help="Triton projections of more rows launch normally (not as dependents)")
    ap.add_argument("--l2", default=None, metavar="KIND=MIB[,KIND=MIB]",
                    help="MiB of the next projection's weight that a fused projection of KIND "
                         "(qkv, o, gate_up, down, or all) warms in L2 (triton_ops)")
    args = ap.parse_args()
    for item in (args.l2.split(",") if args.l2 else []):
        from graphexec.kernels import triton_ops
        kind, mib = item.split("=")
        for key in (triton_ops.L2_PREFETCH_BYTES if kind == "all" else [kind]):
            triton_ops.L2_PREFETCH_BYTES[key] = int(float(mib) * 2**20)
    for item in (args.attn.split(",") if args.attn else []):
        key, value = item.split("=")
        _set_tuning(key, int(value))
    if args.pdl_max_rows is not None:
        lt.PDL_MAX_ROWS = args.pdl_max_rows
    if args.variant == "unfused":
        from graphexec.kernels import triton_ops
        triton_ops.TRITON_SINGLE_ROW_OPS = triton_ops.auto_ops(triton_ops.AUTO_MAX_ROWS)
    elif args.variant == "fused":
        from graphexec.kernels import triton_ops
        if args.fused_qkv is not None:
            limit = 1 << 62 if args.fused_qkv == "triton" else 0
            triton_ops.FUSED_QKV_TRITON_MAX_ELEMENTS = limit
            triton_ops.RANK_QKV_TRITON_MAX_ELEMENTS = limit
        _fused(args.fused_rows, [])
    elif args.variant in ATTENTION_VARIANTS:
        ATTENTION_VARIANTS[args.variant]()
    elif args.variant in STEP_VARIANTS:
        STEP_VARIANTS[args.variant]()
    elif args.variant == "d2h-copy-lmhead-cublas64":
        _d2h_copy()
        _lm_head_cublas64()
    elif args.variant in OP_SET_VARIANTS:
        VARIANTS[args.variant]()
    elif VARIANTS[args.variant] is not None:
        lt.pick_config, lt.pick_norm_config = VARIANTS[args.variant]()
    _override_one_row(args.m1, args.m1_norm, args.only_n)
    _fused_configs(args.fused_config)
    if args.spec:
        import bench_spec

        for row in bench_spec.bench_spec(os.devnull, batches=[args.batch], ks=[4],
                                         projections=args.projections, only=["speed-up"]):
            print(json.dumps(dict(variant=args.variant, **row)))
        return
    res, llm = bench_graphexec(args.model, "async+graphs", args.batch, 128, 128,
                               copy_bandwidth(), args.batch, projections=args.projections)
    llm.close()
    print(json.dumps(dict(variant=args.variant, model=args.model, batch=args.batch,
                          projections=args.projections,
                          decode_step_ms=round(res["decode_step_ms"], 4),
                          gpu_busy_ms=round(res["gpu_busy_ms"], 4),
                          roofline_frac=round(res["roofline_frac"], 3),
                          gpu_idle_frac=round(res["gpu_idle_frac"], 4),
                          tokens_per_s=round(res["tokens_per_s"]))))


if __name__ == "__main__":
    main()
