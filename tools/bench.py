"""Benchmarks. `python tools/bench.py decode|kernels|spec|all [--out DIR]`.

serve: a serving benchmark (offline, Poisson online, shared-prefix workloads; TTFT, ITL,
throughput), with its own options: `python tools/bench.py serve --help` (tools/bench_serve.py).

decode: graphexec (async+graphs, sync+graphs, eager) against HuggingFace transformers (eager,
static cache + torch.compile) with the same prompts and token counts end to end, plus
graphexec's decode-only step time, GPU idle time between steps, host time per step and the
fraction of the HBM roofline (weights + KV bytes per step over the copy bandwidth measured in
the same run). Writes JSON, a PNG plot and markdown tables under --out; `--docs
docs/benchmarks.md` also appends the tables (with date, GPU and command) to that file.
`--tp 1 2` runs each configuration at those tensor_parallel_size values (the roofline is then
per rank); a model named `<preset>-tp<N>rank` is one rank's share of the preset alone, at size 1
(tools/rank_shapes.py). `--quantization none fp8 int4` runs each configuration with its
weights quantized at load, the roofline then from the bytes each format's projections read
(scales included); `--kv-cache-dtype auto fp8` likewise with the KV cache in e4m3. Without
CUDA it still runs (`--models tiny --modes eager --hf-kinds`), to check the
benchmark, not to measure.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graphexec import LLM, SamplingParams  # noqa: E402
from graphexec.kernels import PROJECTIONS  # noqa: E402
from graphexec.rank import kv_bytes_per_block  # noqa: E402
from graphexec.model import preset  # noqa: E402
from graphexec.model.quantize import QUANTIZATIONS, weight_bytes  # noqa: E402
import rank_shapes  # noqa: E402  (tools/, beside this file)

MODES = {"async+graphs": dict(async_scheduling=True, cuda_graphs=True),
         "sync+graphs": dict(async_scheduling=False, cuda_graphs=True),
         "eager": dict(async_scheduling=False, cuda_graphs=False)}


CUDA = torch.cuda.is_available()


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (nan without CUDA: the CPU runs
    only check that the benchmark works, they measure nothing)."""
    if not CUDA:
        return float("nan")
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (s.elapsed_time(e) / 1e3)


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def weight_bytes_per_rank(mc, tp: int) -> int:
    """bf16 bytes of weights one rank reads per step: its share of the layers, its share of
    the LM head (split by vocabulary when tp divides it, as model/shard.py does), and the norms
    whole. An untied embedding table is not counted: a step reads only its batch's rows of it
    (until 2026-11-26 the table was counted whole, which put llama-8b's rooflines 1.05 GB, about
    0.25 ms on an H200, too high)."""
    layers = mc.num_layers * (
        mc.hidden_size * (mc.q_size + 2 * mc.kv_size) + mc.q_size * mc.hidden_size
        + 3 * mc.hidden_size * mc.intermediate_size)
    replicated = mc.streamed_parameters() - layers
    if tp > 1 and mc.vocab_size % tp == 0:
        head = mc.vocab_size * mc.hidden_size  # tied or not, the head streams this much
        replicated -= head - head // tp
    return 2 * (replicated + layers // tp)


def bench_graphexec(model: str, mode: str, batch: int, prompt_len: int, new: int,
                    bandwidth: float, max_batch: int, llm: LLM | None = None,
                    diagnose: bool = False, projections: str = "auto",
                    tp: int = 1, quantization: str = "none",
                    kv_cache_dtype: str = "auto") -> tuple[dict, LLM]:
    mc = preset(model)
    max_len = prompt_len + new + 16
    if llm is None:
        blocks = max_batch * -(-max_len // 16) + 16
        kernels = (dict(batch_invariant=True) if projections == "invariant"
                   else dict(projections=projections))
        llm = LLM(model, max_batch=max_batch, num_kv_blocks=blocks, max_model_len=max_len,
                  tensor_parallel_size=tp, quantization=quantization,
                  kv_cache_dtype=kv_cache_dtype, **kernels, **MODES[mode])
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = _prompts(batch, prompt_len, mc.vocab_size)
    # Warm up with the measured shapes: Triton specialises kernels on sizes, and a JIT compile
    # inside the timed run would be charged to whichever mode ran first.
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    _sync()
    runner.timeline = [] if CUDA else None  # CUDA events around each decode iteration
    runner.wait_seconds = 0.0
    host_step = []
    phases = _PhaseTimer(engine) if diagnose else None
    compiled_before = _triton_cache_entries()
    steps_before = engine.stats.steps
    t0 = time.perf_counter()
    ids = [f"b{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        s = time.perf_counter()
        engine.step()
        host_step.append(time.perf_counter() - s)
    _sync()
    wall = time.perf_counter() - t0
    timeline, runner.timeline = runner.timeline, None
    diag = {}
    if phases is not None:
        diag = phases.report(host_step)
        phases.restore()
    diag["triton_compiles_in_timed_run"] = _triton_cache_entries() - compiled_before
    steps = engine.stats.steps - steps_before
    # Steady state: decode iterations after the first. A gap before an iteration whose launch
    # also ran a prefill (admissions split over several steps by max_prefill_tokens) holds that
    # prefill, not host idleness: those gaps are left out of both step time and idle time.
    # A mixed runner's admitting steps are whole prefill forwards inside the events
    # (capture/mixed.py): not decode steps, so not in the busy time either.
    tl = (timeline or [])[1:-1]
    busy = [s.elapsed_time(e) / 1e3 for s, e, admits in tl if not (admits and runner.mixed)]
    gaps = [tl[i][1].elapsed_time(tl[i + 1][0]) / 1e3 for i in range(len(tl) - 1)
            if not tl[i + 1][2]]
    prefill_steps = sum(1 for t in tl if t[2])
    step_time = (sum(busy) / len(busy) + sum(gaps) / max(len(gaps), 1)) if tl else float("nan")
    # Per rank under tensor parallelism (its weights and its KV heads); the all-reduces' time
    # is not in the floor.
    # a quantized model's floor: the bytes its projections read as stored, scales included
    weights = (weight_bytes_per_rank(mc, tp) if quantization == "none"
               else weight_bytes(engine.model.weights))
    kv_per_token = kv_bytes_per_block(mc, 16, engine.config.kv_dtype) / 16 / tp
    avg_ctx = prompt_len + new / 2
    roofline = (weights + batch * avg_ctx * kv_per_token) / bandwidth
    label = mode if projections == "auto" else f"{mode} {projections}-proj"
    if tp > 1:
        label += f" tp{tp}"
    if quantization != "none":
        label += f" {quantization}"
    if kv_cache_dtype != "auto":
        label += f" kv-{kv_cache_dtype}"
    res = dict(engine="graphexec", mode=label, projections=projections, tensor_parallel_size=tp,
               quantization=quantization, weight_bytes=weights,
               kv_cache_dtype=kv_cache_dtype, kv_bytes_per_token=kv_per_token,
               model=model, batch=batch, prompt=prompt_len,
               new_tokens=new, wall_s=wall, tokens_per_s=batch * new / wall, steps=steps,
               decode_step_ms=step_time * 1e3, decode_tokens_per_s=batch / step_time,
               gpu_busy_ms=sum(busy) / max(len(busy), 1) * 1e3,
               gpu_idle_frac=(sum(gaps) / max(len(gaps), 1)) / step_time if tl else float("nan"),
               host_ms_per_step=(sum(host_step) - runner.wait_seconds) / max(steps, 1) * 1e3,
               roofline_ms=roofline * 1e3, roofline_frac=roofline / step_time,
               prefill_steps_in_steady_state=prefill_steps,
               chain_breaks=engine.stats.chain_breaks, **diag)
    return res, llm


def _triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache: a rise during a timed run means a JIT compile."""
    root = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    return sum(len(files) for _, _, files in os.walk(root)) if os.path.isdir(root) else 0


class _PhaseTimer:
    """Wraps the engine's schedule / launch / reconcile to time each per step (diagnostics:
    finds the steps where host time goes)."""

    def __init__(self, engine):
        self.engine, self.rows = engine, []
        self._orig = (engine.scheduler.schedule, engine._launch, engine._reconcile)
        sched, launch, recon = self._orig
        cur = {}

        runner = engine.runner

        def timed(name, fn):
            def run(*a):
                t, waited = time.perf_counter(), runner.wait_seconds
                out = fn(*a)
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t
                if name == "reconcile":  # of which blocked on the step's results
                    cur["wait"] = cur.get("wait", 0.0) + runner.wait_seconds - waited
                if name == "schedule":
                    cur["rows"] = len(out.rows)
                    cur["prefills"] = len(out.prefills)
                    cur["delta"] = out.delta is not None
                return out
            return run

        def schedule(step_id):
            self.rows.append(cur.copy())
            cur.clear()
            return timed("schedule", sched)(step_id)

        engine.scheduler.schedule = schedule
        engine._launch = timed("launch", launch)
        engine._reconcile = timed("reconcile", recon)
        self._cur = cur

    def report(self, host_step: list[float]) -> dict:
        self.rows.append(self._cur.copy())
        rows = self.rows[1:]
        slow = sorted(range(len(host_step)), key=lambda i: -host_step[i])[:5]
        ms = lambda d: {k: round(v * 1e3, 3) if isinstance(v, float) else v for k, v in d.items()}
        phases = ("schedule", "launch", "reconcile", "wait")
        mean = {p: sum(r.get(p, 0.0) for r in rows) / max(len(rows), 1) for p in phases}
        mean["step"] = sum(host_step) / max(len(host_step), 1)
        return dict(mean_phase_ms=ms(mean), slowest_steps=[dict(step=i, host_ms=round(host_step[i] * 1e3, 3),
                                        **ms(rows[i] if i < len(rows) else {})) for i in slow])

    def restore(self) -> None:
        e = self.engine
        del e.scheduler.schedule, e._launch, e._reconcile


def bench_hf(model: str, kind: str, batch: int, prompt_len: int, new: int) -> dict | None:
    try:
        import transformers
    except ImportError:
        return None
    mc = preset(model)
    cfg = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, max_position_embeddings=8192, rope_theta=mc.rope_theta,
        tie_word_embeddings=mc.tie_word_embeddings)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    if kind == "static+compile":
        # transformers compiles the forward itself for a static cache (generation_config's
        # compile_config); wrapping it again with reduce-overhead breaks generate.
        hf.generation_config.cache_implementation = "static"
    ids = torch.tensor(_prompts(batch, prompt_len, mc.vocab_size), device="cuda")
    with torch.no_grad():
        for _ in range(2 if kind == "static+compile" else 1):  # compile + warm the graphs
            hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    return dict(engine="transformers", mode=kind, model=model, batch=batch, prompt=prompt_len,
                new_tokens=new, wall_s=wall, tokens_per_s=batch * new / wall,
                ms_per_token_step=wall / new * 1e3)


def run_decode(models, batches, shapes, hf_batches, out_dir,
               hf_kinds=("eager", "static+compile"), modes=tuple(MODES),
               diagnose: bool = False, projections=("auto",), tps=(1,),
               quantizations=("none",), kv_dtypes=("auto",)) -> list[dict]:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = [dict(engine="hbm", copy_bandwidth_TBps=bw / 1e12)]
    for model in models:
        for mode, proj, tp, quant, kv in itertools.product(modes, projections, tps,
                                                           quantizations, kv_dtypes):
            for prompt_len, new in shapes:
                llm = None  # a new engine per shape: max_model_len and KV sized for it
                for batch in batches:
                    res, llm = bench_graphexec(model, mode, batch, prompt_len, new, bw,
                                               max(batches), llm, diagnose, proj, tp,
                                               quant, kv)
                    print(json.dumps(res))
                    rows.append(res)
                # Free this engine's graphs, buffers and KV before the next configuration's
                # timed run (later engines showed host stalls while earlier ones lingered).
                if llm is not None:
                    llm.close()
                del llm
        for kind in hf_kinds:
            for batch in hf_batches:
                prompt_len, new = shapes[0]
                try:
                    res = bench_hf(model, kind, batch, prompt_len, new)
                except Exception as e:  # report, keep the rest of the run
                    res = dict(engine="transformers", mode=kind, model=model, batch=batch,
                               error=repr(e)[:300])
                if res:
                    print(json.dumps(res))
                    rows.append(res)
        with open(os.path.join(out_dir, f"decode_{model}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    ours = [r for r in rows if r.get("engine") == "graphexec"]
    models = sorted({r["model"] for r in ours})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for j, model in enumerate(models):
        for mode in sorted({r["mode"] for r in ours}):  # with the kernel set in the label
            for shape in sorted({(r["prompt"], r["new_tokens"]) for r in ours}):
                pts = sorted((r["batch"], r["tokens_per_s"], r["roofline_frac"]) for r in ours
                             if r["model"] == model and r["mode"] == mode
                             and (r["prompt"], r["new_tokens"]) == shape)
                if not pts:
                    continue
                label = f"{mode} {shape[0]}+{shape[1]}"
                axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
                axes[1][j].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
        for r in rows:
            if r.get("engine") == "transformers" and r.get("model") == model and "tokens_per_s" in r:
                axes[0][j].plot([r["batch"]], [r["tokens_per_s"]], "x", ms=10,
                                label=f"HF {r['mode']} b{r['batch']}")
        axes[0][j].set(title=f"{model}: tokens/s (end to end)", xscale="log", yscale="log",
                       xlabel="batch")
        axes[1][j].set(title=f"{model}: fraction of HBM roofline (decode step)", xscale="log",
                       xlabel="batch", ylim=(0, 1.05))
        axes[0][j].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows: list[dict], command: str) -> str:
    gpu = torch.cuda.get_device_name() if CUDA else "CPU (no CUDA: nothing measured)"
    bw = next(r["copy_bandwidth_TBps"] for r in rows if r.get("engine") == "hbm")
    lines = [f"Measured {datetime.date.today()} on {gpu}, torch {torch.__version__}, "
             f"copy bandwidth {bw:.2f} TB/s. Command: `{command}`.", "",
             "| model | mode | batch | prompt+new | tok/s (e2e) | decode step ms | roofline ms |"
             " roofline frac | GPU idle | host ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("engine") != "graphexec":
            continue
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['prompt']}+"
                     f"{r['new_tokens']} | {r['tokens_per_s']:,.0f} | {r['decode_step_ms']:.3f} "
                     f"| {r['roofline_ms']:.3f} | {r['roofline_frac']:.2f} | "
                     f"{100 * r['gpu_idle_frac']:.1f}% | {r['host_ms_per_step']:.3f} |")
    lines += ["", "| model | transformers | batch | prompt+new | tok/s (e2e) | ms/step |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("engine") == "transformers":
            if "error" in r:
                lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | - | failed: "
                             f"{r['error'][:80]} | - |")
            else:
                lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['prompt']}+"
                             f"{r['new_tokens']} | {r['tokens_per_s']:,.0f} | "
                             f"{r['ms_per_token_step']:.2f} |")
    return "\n".join(lines)


def _append_docs(path: str | None, title: str, md: str) -> None:
    """Appends one measured section (its tables carry date, GPU and command) to path."""
    if path is None:
        return
    with open(path, "a") as f:
        f.write(f"\n### {title}, {datetime.date.today().isoformat()}\n\n{md}\n")


def main() -> None:
    if sys.argv[1:2] == ["serve"]:  # its own option set
        import bench_serve

        bench_serve.main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["decode", "kernels", "spec", "serve", "all"])
    ap.add_argument("--models", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=None,
                    help="decode: 1 16 64 256; spec: 1 16 64")
    ap.add_argument("--hf-batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--shapes", nargs="+", default=["128+128", "1024+256"])
    ap.add_argument("--hf-kinds", nargs="*", default=["eager", "static+compile"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--projections", nargs="+", default=["auto"],
                    choices=[*PROJECTIONS, "invariant"],
                    help="decode: who runs the projections (invariant: batch_invariant=True)")
    ap.add_argument("--spec-ks", nargs="+", type=int, default=[1, 2, 4],
                    help="spec: K of the overhead set-ups")
    ap.add_argument("--spec-setups", nargs="+", default=None,
                    help="spec: only the set-ups whose names start with these (plain always "
                         "runs), e.g. speed-up")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="spec: run every set-up on the batch-invariant kernels")
    ap.add_argument("--tp", nargs="+", type=int, default=[1],
                    help="decode: tensor_parallel_size values, one engine each (e.g. 1 2)")
    ap.add_argument("--diagnose", action="store_true",
                    help="time schedule/launch/reconcile per step, list the slowest steps")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    choices=list(QUANTIZATIONS),
                    help="decode: weights quantized at load; the roofline counts the bytes "
                         "each format reads")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=["auto", "fp8"],
                    help="decode: the KV cache's dtype; the roofline counts its bytes")
    ap.add_argument("--out", default="out")
    ap.add_argument("--docs", default=None,
                    help="append the markdown tables to this file (docs/benchmarks.md)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    command = "python tools/bench.py " + " ".join(sys.argv[1:])
    if args.what in ("kernels", "all"):
        from bench_kernels import bench_kernels

        bench_kernels(os.path.join(args.out, "kernels.json"))
    if args.what in ("spec", "all"):
        import bench_spec

        rows = bench_spec.bench_spec(os.path.join(args.out, "spec.json"),
                                     batches=args.batches or [1, 16, 64], ks=args.spec_ks,
                                     batch_invariant=args.batch_invariant,
                                     projections=args.projections[0],
                                     only=args.spec_setups)
        md = bench_spec.markdown(rows, command)
        with open(os.path.join(args.out, "spec.md"), "w") as f:
            f.write(md + "\n")
        _append_docs(args.docs, "Speculative decoding: `tools/bench.py spec`", md)
        print(md)
    if args.what in ("decode", "all"):
        for model in args.models:
            rank_shapes.register(model)
            if rank_shapes.is_rank_share(model) and args.tp != [1]:
                ap.error(f"--models {model}: one rank's share runs at --tp 1 only")
        shapes = [tuple(int(x) for x in s.split("+")) for s in args.shapes]
        batches = args.batches or [1, 16, 64, 256]
        rows = run_decode(args.models, batches, shapes, args.hf_batches, args.out,
                          args.hf_kinds, args.modes, args.diagnose, args.projections, args.tp,
                          args.quantization, args.kv_cache_dtype)
        tag = "-".join(args.models)
        plot(rows, os.path.join(args.out, f"decode_{tag}.png"))
        md = markdown(rows, command)
        with open(os.path.join(args.out, f"decode_{tag}.md"), "w") as f:
            f.write(md + "\n")
        _append_docs(args.docs, f"Decode: `tools/bench.py decode` ({', '.join(args.models)})", md)
        print(md)


if __name__ == "__main__":
    main()
