"""Microbenchmarks of the Triton kernels on CUDA.

    python tools/bench_kernels.py --out kernels.json

Reports, for each kernel, the time per call measured two ways: replayed from a CUDA graph
(`graph_us`, how the engine runs a decode step; no launch overhead) and eagerly with CUDA events
(`eager_us`, with the L2 flushed between calls by triton.testing.do_bench). Bandwidth figures use
bytes read + written over graph_us and are compared with a large device-to-device copy. Last,
the llama-1b decode forward at batch 1 (bench_forward; alone: --forward) against its roofline.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _graph_time_us(fn, reps: int = 20) -> float:
    """Median time of one call, from a CUDA graph holding `reps` back-to-back calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / reps)
    times.sort()
    return times[len(times) // 2]


def _eager_time_us(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")) * 1000.0


def _copy_bandwidth() -> dict:
    """Device-to-device copy of 1 GiB, bytes read + written over time: torch's copy_ and a plain
    Triton copy kernel; the faster one is the reference for the memory-bound kernels."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)

    n = 1 << 28  # fp32 elements: 1 GiB
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1.0)
    nbytes = 2 * 4 * n
    torch_us = _graph_time_us(lambda: dst.copy_(src), reps=5)
    triton_us = _graph_time_us(
        lambda: _copy[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8), reps=5)
    del src, dst
    best = min(torch_us, triton_us)
    return {"bytes": nbytes, "torch_copy_us": torch_us, "triton_copy_us": triton_us,
            "torch_GB_per_s": nbytes / (torch_us * 1e-6) / 1e9,
            "triton_GB_per_s": nbytes / (triton_us * 1e-6) / 1e9,
            "GB_per_s": nbytes / (best * 1e-6) / 1e9}


def _paged_cache(b, ctx, hk, d, bs, dtype, extra_cols=0):
    blocks_per = (ctx + bs - 1) // bs
    nb = b * blocks_per + 1
    k = torch.randn(nb, bs, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(nb, bs, hk, d, device="cuda", dtype=dtype)
    perm = torch.randperm(b * blocks_per, device="cuda").int()
    tables = torch.full((b, blocks_per + extra_cols), nb - 1, dtype=torch.int32, device="cuda")
    tables[:, :blocks_per] = perm.view(b, blocks_per)
    return k, v, tables


def bench_kernels(out_json_path: str | None = None, verbose: bool = True) -> dict:
    from graphexec.kernels import attention as attn_ref
    from graphexec.kernels import rmsnorm as norm_ref
    from graphexec.kernels import rope as rope_ref
    from graphexec.kernels import sampling as samp_ref
    from graphexec.kernels import attention_decode_triton as at
    from graphexec.kernels import norm_rope_triton as nr
    from graphexec.kernels import write_kv_triton
    from graphexec.kernels.triton_ops import TRITON_OPS as ops

    assert torch.cuda.is_available(), "bench_kernels needs CUDA"
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results: dict = {"device": props.name, "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    copy = _copy_bandwidth()
    results["copy"] = copy
    copy_gbps = copy["GB_per_s"]
    rows = []

    def record(name, fn, nbytes=None, ref_fn=None, extra=None):
        g_us = _graph_time_us(fn)
        e_us = _eager_time_us(fn)
        entry = {"graph_us": g_us, "eager_us": e_us}
        if nbytes is not None:
            gbps = nbytes / (g_us * 1e-6) / 1e9
            entry.update(bytes=nbytes, GB_per_s=gbps, frac_of_copy=gbps / copy_gbps)
        if ref_fn is not None:
            entry["reference_graph_us"] = _graph_time_us(ref_fn, reps=3)
        if extra:
            entry.update(extra)
        results[name] = entry
        rows.append((name, entry))
        torch.cuda.empty_cache()

    # --- paged decode attention: Llama-8B heads, batch 64, context 2048, bf16, block 16
    b, ctx, hq, hk, d, bs = 64, 2048, 32, 8, 128, 16
    dtype = torch.bfloat16
    k, v, tables = _paged_cache(b, ctx, hk, d, bs, dtype)
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
    sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    kv_bytes = 2 * b * ctx * hk * d * k.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + tables.numel() * 4
    scale = d ** -0.5
    splits = at._decode_num_splits(b, hk, tables.shape[1], bs, 64, q.device)
    record("decode_attention_b64_ctx2048",
           lambda: ops.decode_attention(q, k, v, tables, sl, scale), io_bytes,
           ref_fn=lambda: attn_ref.paged_decode_attention_ref(q, k, v, tables, sl, scale),
           extra={"num_splits": splits})
    for s in (1, 2, 4, 8):
        record(f"decode_attention_b64_ctx2048_splits{s}",
               lambda s=s: at.decode_attention_splits(q, k, v, tables, sl, scale, s), io_bytes)
    # what the engine runs at decode: rope on q and the new K, its K/V write, and attention in
    # one kernel (each row's new token goes to its last slot, position ctx - 1)
    from graphexec.kernels.rope import rope_cos_sin
    cos, sin = rope_cos_sin(ctx, d, 500000.0, device="cuda")
    k_new = torch.randn(b, hk, d, device="cuda", dtype=dtype)
    v_new = torch.randn(b, hk, d, device="cuda", dtype=dtype)
    pos = torch.full((b,), ctx - 1, dtype=torch.int64, device="cuda")
    last_slot = (tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs)
    record("rope_decode_attention_b64_ctx2048",
           lambda: ops.rope_decode_attention(q, k_new, v_new, pos, cos, sin, k, v, last_slot,
                                             tables, sl, scale), io_bytes,
           extra={"num_splits": splits})
    # the engine's block tables are as wide as the longest context allowed (here 32k)
    wide = tables[:, :1].repeat(1, 32768 // bs)
    wide[:, :tables.shape[1]] = tables
    record("decode_attention_b64_ctx2048_table32k",
           lambda: ops.decode_attention(q, k, v, wide, sl, scale), io_bytes,
           extra={"num_splits": at._decode_num_splits(b, hk, wide.shape[1], bs, 64, q.device)})
    del k, v, tables, wide
    torch.cuda.empty_cache()
    # batch 64, short context (the 128 + 128 decode benchmark's mean is 192): one split by
    # default (512 programs already), is splitting the 3 tiles of a row any faster?
    ctx3 = 192
    k, v, tables = _paged_cache(b, ctx3, hk, d, bs, dtype)
    sl3 = torch.full((b,), ctx3, dtype=torch.int32, device="cuda")
    io3 = 2 * b * ctx3 * hk * d * k.element_size() + 2 * q.numel() * q.element_size()
    for s in (1, 2, 3):
        record(f"decode_attention_b64_ctx192_splits{s}",
               lambda s=s: at.decode_attention_splits(q, k, v, tables, sl3, scale, s), io3)
    del k, v, tables
    # small batch, long context (split-K matters here)
    b2, ctx2 = 4, 8192
    k, v, tables = _paged_cache(b2, ctx2, hk, d, bs, dtype)
    q2 = torch.randn(b2, hq, d, device="cuda", dtype=dtype)
    sl2 = torch.full((b2,), ctx2, dtype=torch.int32, device="cuda")
    io2 = 2 * b2 * ctx2 * hk * d * 2 + 2 * q2.numel() * 2
    record("decode_attention_b4_ctx8192",
           lambda: ops.decode_attention(q2, k, v, tables, sl2, scale), io2,
           extra={"num_splits": at._decode_num_splits(b2, hk, tables.shape[1], bs, 64,
                                                      q2.device)})
    del k, v, tables

    # batch 1, llama-1b heads (32 q / 8 kv, d 64), the block table of an 8k context: a short
    # row (the 128 + 128 benchmark's) and a long one, under each split floor (min_tiles)
    b1, d1, width = 1, 64, 8192
    k, v, tables = _paged_cache(b1, width, hk, d1, bs, dtype)
    q1 = torch.randn(b1, hq, d1, device="cuda", dtype=dtype)
    for ctx1 in (192, 8192):
        sl1 = torch.full((b1,), ctx1, dtype=torch.int32, device="cuda")
        io1 = 2 * ctx1 * hk * d1 * 2 + 2 * q1.numel() * 2
        for mt in (1, 2, 4, 8):
            record(f"decode_attention_b1_ctx{ctx1}_d64_min_tiles{mt}",
                   lambda sl1=sl1, mt=mt: at.decode_attention_splits(
                       q1, k, v, tables, sl1, d1 ** -0.5, None, min_tiles=mt), io1,
                   extra={"num_splits": at._decode_num_splits(b1, hk, tables.shape[1], bs, 64,
                                                              q1.device)})
    del k, v, tables

    # --- prefill: one 2048-token prompt, Llama-8B heads
    t = 2048
    k, v, tables = _paged_cache(1, t, hk, d, bs, dtype)
    qp = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    slp = torch.tensor([t], dtype=torch.int32, device="cuda")
    flops = 4 * hq * d * t * t / 2  # causal
    record("prefill_attention_t2048", lambda: ops.prefill_attention(qp, k, v, cu, slp, tables,
                                                                     scale))
    results["prefill_attention_t2048"]["TFLOP_per_s"] = (
        flops / (results["prefill_attention_t2048"]["graph_us"] * 1e-6) / 1e12)
    del k, v, tables

    # --- sampling: batch 64, vocab 128256
    bsz, vocab = 64, 128256
    logits = torch.randn(bsz, vocab, device="cuda") * 2.0
    temp = torch.full((bsz,), 0.8, device="cuda")
    top_k = torch.full((bsz,), 50, dtype=torch.int64, device="cuda")
    top_p = torch.full((bsz,), 0.9, device="cuda")
    seeds = torch.arange(bsz, device="cuda", dtype=torch.int64)
    steps = torch.zeros(bsz, device="cuda", dtype=torch.int64)
    lb = logits.numel() * 4
    record("sample_b64_v128256_topk50_topp0.9",
           lambda: ops.sample(logits, temp, top_k, top_p, seeds, steps), lb,
           ref_fn=lambda: samp_ref.sample_ref(logits, temp, top_k, top_p, seeds, steps))
    no_k = torch.zeros_like(top_k)
    no_p = torch.ones_like(top_p)
    record("sample_b64_v128256_plain", lambda: ops.sample(logits, temp, no_k, no_p, seeds, steps),
           lb)
    record("sample_b64_v128256_greedy",
           lambda: ops.sample(logits, torch.zeros_like(temp), no_k, no_p, seeds, steps), lb)
    record("sample_b64_v128256_topp0.9_only",
           lambda: ops.sample(logits * 4, temp, no_k, top_p, seeds, steps), lb,
           extra={"note": "peaked logits (x8 randn): top-p bound found from the chunk tables"})
    flat = torch.randn(bsz, vocab, device="cuda") * 0.1
    record("sample_b64_v128256_topp0.9_flat",
           lambda: ops.sample(flat, temp, no_k, top_p, seeds, steps), lb,
           extra={"note": "flat logits: every row takes the exact full-row fallback"})
    # the engine hands the sampler the LM head's bf16 logits (upcast as they are read)
    logits16 = logits.bfloat16()
    record("sample_b64_v128256_topk50_topp0.9_bf16",
           lambda: ops.sample(logits16, temp, top_k, top_p, seeds, steps), logits16.numel() * 2)
    del logits, flat, logits16

    # --- norms, rope, write_kv at decode sizes (64 tokens, Llama-8B)
    hidden = 4096
    x = torch.randn(64, hidden, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    record("rms_norm_64x4096", lambda: ops.rms_norm(x, w, 1e-5), 2 * x.numel() * 2,
           ref_fn=lambda: norm_ref.rms_norm_ref(x, w, 1e-5))
    record("add_rms_norm_64x4096", lambda: nr.add_rms_norm(x, r, w, 1e-5), 4 * x.numel() * 2,
           ref_fn=lambda: norm_ref.add_rms_norm_ref(x, r, w, 1e-5))
    qkv = torch.randn(64, (hq + 2 * hk) * d, device="cuda", dtype=dtype)
    qq, kk, vv = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    qq = qq.reshape(64, hq, d)
    kk = kk.reshape(64, hk, d)
    vv = vv.reshape(64, hk, d)
    cos, sin = rope_ref.rope_cos_sin(8192, d, 500000.0, device="cuda")
    pos = torch.randint(0, 8192, (64,), device="cuda")
    record("rope_64tok_32q8k_d128", lambda: nr.apply_rope(qq, kk, pos, cos, sin),
           2 * (qq.numel() + kk.numel()) * 2,
           ref_fn=lambda: rope_ref.apply_rope_ref(qq, kk, pos, cos, sin))
    kc = torch.zeros(1024, 16, hk, d, device="cuda", dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(1024 * 16, device="cuda")[:64]
    record("write_kv_64tok", lambda: write_kv_triton.write_kv(kc, vc, kk, vv, slots),
           4 * kk.numel() * 2)

    # the llama-1b decode forward at batch 1 against its roofline: the figure the kernels
    # are judged by (docs/benchmarks.md, "Kernels", first measured 2026-11-24 at cfeb460)
    torch.cuda.empty_cache()
    results["forward_llama-1b_b1"] = forward = bench_forward("llama-1b",
                                                             copy_gbps=_strict_copy_gbps(copy))

    if verbose:
        print(f"device: {results['device']}  torch {results['torch']}  triton {results['triton']}")
        print(f"copy bandwidth: {copy_gbps:.0f} GB/s (1 GiB device-to-device, read + write; "
              f"torch copy_ {copy['torch_GB_per_s']:.0f}, Triton copy "
              f"{copy['triton_GB_per_s']:.0f})")
        print(f"{'kernel':44s} {'graph us':>9s} {'eager us':>9s} {'GB/s':>7s} {'of copy':>8s}"
              f" {'ref us':>8s}")
        for name, e in rows:
            gb = f"{e['GB_per_s']:.0f}" if "GB_per_s" in e else ""
            fr = f"{e['frac_of_copy'] * 100:.0f}%" if "frac_of_copy" in e else ""
            ref = f"{e['reference_graph_us']:.1f}" if "reference_graph_us" in e else ""
            print(f"{name:44s} {e['graph_us']:9.1f} {e['eager_us']:9.1f} {gb:>7s} {fr:>8s}"
                  f" {ref:>8s}")
        print(f"llama-1b decode forward, batch 1, context {forward['context']}: "
              f"{forward['forward_us']:.1f} us, roofline {forward['roofline_us']:.1f} us "
              f"({forward['vs_roofline']:.3f}x)")
        if "TFLOP_per_s" in results["prefill_attention_t2048"]:
            print(f"prefill attention: "
                  f"{results['prefill_attention_t2048']['TFLOP_per_s']:.0f} TFLOP/s (causal)")
    if out_json_path:
        with open(out_json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


# (name, batch, context, q heads, kv heads, head dim): the decode attention of llama-1b's
# benchmark at batch 1 and 64, a long batch-1 row, Llama-8B's batch 64 x 2048 case, and
# llama-8b's benchmark at batch 64 whole and as one rank of tensor_parallel_size 2 holds it
SWEEP_SHAPES = [("b1_ctx192_d64", 1, 192, 32, 8, 64), ("b64_ctx192_d64", 64, 192, 32, 8, 64),
                ("b1_ctx8192_d64", 1, 8192, 32, 8, 64),
                ("b64_ctx2048_d128", 64, 2048, 32, 8, 128),
                ("b64_ctx192_d128", 64, 192, 32, 8, 128),
                ("b64_ctx192_d128_tp2", 64, 192, 16, 4, 128)]


SWEEP_LAYERS = 8


def sweep_attention(out_json_path: str | None = None, block_ns=(32, 64, 128),
                    warps=(2, 4, 8), stages=(2, 3), shapes: list[str] | None = None,
                    splits=(0,)) -> dict:
    """Decode attention (rope fused, as a decode step runs it) under each launch config (the
    decode fields of kernels/tuning.py's AttentionTuning), per shape of SWEEP_SHAPES (those
    named in shapes, when given): graph microseconds. splits: the most splits a row takes (0:
    the table's)."""
    from dataclasses import replace

    from graphexec.kernels import attention_decode_triton as at
    from graphexec.kernels.rope import rope_cos_sin
    from graphexec.kernels.tuning import DEFAULT

    bs, dtype = 16, torch.bfloat16
    results: dict = {"device": torch.cuda.get_device_properties(0).name}
    for name, b, ctx, hq, hk, d in SWEEP_SHAPES:
        if shapes and name not in shapes:
            continue
        # several layers' caches in turn, as a decode step reads them: a cache read again and
        # again would be served from L2 (llama-8b's batch-64 cache is 25-50 MB a layer)
        caches = [_paged_cache(b, 8192 if b == 1 else ctx, hk, d, bs, dtype)
                  for _ in range(SWEEP_LAYERS)]
        tables = caches[0][2]
        turn = itertools.cycle(caches)
        q = torch.randn(b, hq, d, device="cuda", dtype=dtype)
        kn = torch.randn(b, hk, d, device="cuda", dtype=dtype)
        vn = torch.randn(b, hk, d, device="cuda", dtype=dtype)
        sl = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        pos = (sl - 1).long()
        slots = tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
        cos, sin = rope_cos_sin(8192, d, 500000.0, device="cuda")
        for bn, w, st, sp in itertools.product(block_ns, warps, stages, splits):
            tuning = replace(DEFAULT.attention, decode_block_n=bn, decode_narrow_block_n=bn,
                             decode_warps=w, decode_small_head_warps=w, decode_stages=st,
                             **({"max_splits": sp} if sp else {}))
            key = f"{name}_n{bn}_w{w}_s{st}" + (f"_x{sp}" if sp else "")
            try:
                us = _graph_time_us(lambda: at.rope_decode_attention(
                    q, kn, vn, pos, cos, sin, *next(turn)[:2], slots, tables, sl,
                    d ** -0.5, tuning=tuning), reps=2 * SWEEP_LAYERS)
            except Exception as e:  # a config that does not fit (shared memory)
                results[key] = {"error": type(e).__name__}
                print(f"{key:<40} {type(e).__name__}", flush=True)
                continue
            results[key] = {"graph_us": us}
            print(f"{key:<40} {us:8.2f} us", flush=True)
        del caches, tables, turn
        torch.cuda.empty_cache()
    if out_json_path:
        with open(out_json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


def bench_forward(model: str = "llama-1b", batch: int = 1, context: int = 192,
                  copy_gbps: float | None = None) -> dict:
    """The decode forward alone, as docs/benchmarks.md ("Kernels") reports it: embedding through
    the LM head's logits for `batch` rows at `context` tokens each (the new one included), 20
    forwards captured back to back in one CUDA graph and replayed. No sampling, stop-token mask
    or advance (tools/bench.py decode times whole steps with those). Roofline: weights + the
    rows' KV bytes over the copy bandwidth, as in tools/bench.py (weights = every parameter
    once)."""
    from graphexec import LLM
    from graphexec.model import preset
    from graphexec.model.llama import AttentionInputs
    from graphexec.rank import kv_bytes_per_block

    copy_gbps = copy_gbps or _copy_bandwidth()["GB_per_s"]
    mc, bs = preset(model), 16
    cols = -(-context // bs)
    llm = LLM(model, max_batch=batch, num_kv_blocks=batch * cols + 16,
              max_model_len=context + 16, cuda_graphs=False, async_scheduling=False)
    eng = llm.engine
    for cache in (*eng.kv.k, *eng.kv.v):  # written KV is finite; the values do not matter
        cache.normal_()
    dev = torch.device(eng.config.device)
    tables = torch.arange(batch * cols, dtype=torch.int32, device=dev).view(batch, cols)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=dev)
    ids = torch.randint(3, mc.vocab_size, (batch,), device=dev)
    slots, seq_lens = eng.model.ops.decode_metadata(positions, tables, bs)
    attn = AttentionInputs(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                           rows_are_sequences=True)
    out = {}

    def forward():
        out["logits"] = eng.model.compute_logits(eng.model.forward(ids, positions, attn, eng.kv))
    us = _graph_time_us(forward, reps=20)
    assert torch.isfinite(out["logits"].float()).all(), "forward produced non-finite logits"
    nbytes = mc.streamed_parameters() * 2 + batch * context * kv_bytes_per_block(
        mc, bs, torch.bfloat16) / bs
    roofline_us = nbytes / (copy_gbps * 1e9) * 1e6
    llm.close()
    return dict(model=model, batch=batch, context=context, forward_us=us,
                roofline_us=roofline_us, vs_roofline=us / roofline_us, copy_GB_per_s=copy_gbps)


def _strict_copy_gbps(copy: dict) -> float:
    """The faster of this module's copies and tools/bench.py's (uint8, timed with events): the
    higher bandwidth gives the lower roofline, the stricter goal."""
    from bench import copy_bandwidth

    return max(copy["GB_per_s"], copy_bandwidth() / 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--forward", nargs="*", metavar="MODEL", default=None,
                    help="instead: the decode forward alone at batch 1, context 192 (as "
                         "docs/benchmarks.md reports it; default llama-1b), printed as JSON "
                         "lines")
    ap.add_argument("--sweep-attention", action="store_true",
                    help="instead: decode attention under alternative launch configs")
    ap.add_argument("--block-n", nargs="+", type=int, default=[32, 64, 128],
                    help="with --sweep-attention: keys per tile to try")
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--splits", nargs="+", type=int, default=[0],
                    help="with --sweep-attention: most splits a row (0: the default rule)")
    ap.add_argument("--shapes", nargs="+", default=None,
                    choices=[shape[0] for shape in SWEEP_SHAPES],
                    help="with --sweep-attention: only these shapes")
    args = ap.parse_args()
    if args.forward is not None:
        copy_gbps = _strict_copy_gbps(_copy_bandwidth())
        rows = [bench_forward(m, copy_gbps=copy_gbps) for m in args.forward or ["llama-1b"]]
        for row in rows:
            print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    elif args.sweep_attention:
        sweep_attention(args.out, args.block_n, args.warps, args.stages, args.shapes,
                        args.splits)
    else:
        bench_kernels(args.out)


if __name__ == "__main__":
    main()
