"""Prebuild a deployment: compile every kernel, capture every bucket, check each replay against
eager, and write a manifest that LLM(..., manifest=...) reads.

    python tools/capture.py --model llama-1b --out manifest.json [--buckets 1 2 4 8 ...]

Exits non-zero when a bucket's replay does not match the eager iteration.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graphexec import Engine, SamplingParams  # noqa: E402
from graphexec.kernels import PROJECTIONS  # noqa: E402
from graphexec.capture.manifest import (BucketEntry, Manifest, current_versions,  # noqa: E402
                                        kernel_set)


def _run(engine: Engine, prompts, logprobs: int | None) -> dict[str, list]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    base = engine.stats.steps
    for i, p in enumerate(prompts):
        engine.add_request(f"parity-{base}-{i}", p, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id.rsplit("-", 1)[1]] = o
    return out


def bucket_parity(engine: Engine, bucket: int) -> tuple[bool, float]:
    """Runs `bucket` rows through the graph, then through the eager iteration; returns whether
    the greedy tokens agree and the largest logprob difference."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(bucket)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 48, (bucket,), generator=g)]
    graphs = engine.runner.graphs
    with_graphs = _run(engine, prompts, logprobs=1)
    engine.runner.graphs = None
    try:
        eager = _run(engine, prompts, logprobs=1)
    finally:
        engine.runner.graphs = graphs
    same, err = True, 0.0
    for k, o in eager.items():
        same &= o.token_ids == with_graphs[k].token_ids
        for a, b in zip(o.logprobs, with_graphs[k].logprobs):
            err = max(err, abs(a.logprob - b.logprob))
    return same, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--buckets", nargs="+", type=int)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tolerance", type=float, default=5e-2, help="max logprob difference")
    ap.add_argument("--projections", default="auto", choices=PROJECTIONS)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--out", default="manifest.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tools/capture.py needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    max_batch = max(args.buckets) if args.buckets else args.max_batch
    engine = Engine(args.model, dtype=args.dtype, max_batch=max_batch, buckets=args.buckets,
                    max_model_len=args.max_model_len, cuda_graphs=True,
                    projections=args.projections, batch_invariant=args.batch_invariant)
    start_s = time.perf_counter() - t0
    reports = {r.bucket: [] for r in engine.runner.graphs.reports}
    for r in engine.runner.graphs.reports:
        reports[r.bucket].append(r)
    entries, failed = [], []
    print(f"engine start (load + kernels + capture): {start_s:.1f} s")
    print(f"{'bucket':>6} {'capture ms':>11} {'graph MiB':>10} {'parity err':>11}  ok")
    for bucket in sorted(reports):
        same, err = bucket_parity(engine, bucket)
        ok = same and err <= args.tolerance
        cap = sum(r.capture_ms for r in reports[bucket])
        mib = sum(r.graph_mib for r in reports[bucket])
        entries.append(BucketEntry(bucket, cap, mib, err))
        print(f"{bucket:>6} {cap:>11.1f} {mib:>10.1f} {err:>11.2e}  {'yes' if ok else 'NO'}")
        if not ok:
            failed.append(bucket)
    Manifest(model=args.model, dtype=args.dtype, gpu=torch.cuda.get_device_name(),
             versions=current_versions(), max_batch=max_batch,
             max_model_len=args.max_model_len, block_size=engine.config.block_size,
             buckets=entries,
             triton_cache_dir=os.environ.get("TRITON_CACHE_DIR"),
             kernels=kernel_set(args.projections, args.batch_invariant)).save(args.out)
    print(f"manifest written to {args.out}")
    if failed:
        print(f"parity FAILED for buckets {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
