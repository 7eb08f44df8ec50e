"""The serving benchmark's report (tools/bench_serve.py): what a run recorded (per-request
traces, filled by either driver: in-process or HTTP), the metrics of a run, the markdown tables
and the plot."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from serve_workload import Workload

# stats_summary() keys that count from the engine's start: a run reports its own increase.
CUMULATIVE = ("steps", "tokens", "chain_breaks", "idle_drains", "pauses", "evictions",
              "admitted", "prefix_query_tokens", "prefix_hit_tokens")


# -- what a run recorded ------------------------------------------------------------------------

@dataclass
class RequestTrace:
    request_id: str
    arrival: float  # s since the run started
    prompt_len: int
    asked: int
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0
    first_chunk_tokens: int = 0  # tokens that came with the first (they add no gap to itl)
    itl: list[float] = field(default_factory=list)
    _last: float = 0.0

    def on_tokens(self, t: float, n: int) -> None:
        if n == 0:
            return
        if self.first_token is None:
            self.first_token = t
            self.first_chunk_tokens = n
        else:
            self.itl += [(t - self._last) / n] * n
        self._last = t
        self.tokens += n

    def problem(self) -> str | None:
        """Why this request did not come back whole, or None."""
        if self.finish is None:
            return f"{self.request_id}: never finished ({self.tokens} of {self.asked} tokens)"
        if self.tokens != self.asked:
            return f"{self.request_id}: {self.tokens} tokens, asked for {self.asked}"
        return None


class IncompleteRun(RuntimeError):
    """Requests of a run were lost, cut or came back with the wrong length."""


def incomplete_requests(workload: Workload,
                        traces: dict[str, RequestTrace]) -> list[str]:
    """One line per request of the workload that did not come back whole; [] when none."""
    out = []
    for spec in workload.requests:
        tr = traces.get(spec.request_id)
        if tr is None:
            out.append(f"{spec.request_id}: never sent")
        elif (p := tr.problem()) is not None:
            out.append(p)
    return out


@dataclass
class StepSample:
    t: float  # when Engine.step returned, s since the run started
    wall: float  # s inside Engine.step
    tokens: int  # new tokens it returned
    batch: float | None  # rows launched (engine.stats), when readable


@dataclass
class RunTrace:
    requests: dict[str, RequestTrace]
    steps: list[StepSample]
    wall: float
    drafted: int = 0
    accepted: int = 0


# -- per-run metrics ----------------------------------------------------------------------------

MAX_PROBLEMS = 20  # a run that lost hundreds of requests needs a few examples, not all

@dataclass
class Percentiles:
    """Linear interpolation between closest ranks (numpy's default); None with no samples."""

    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    mean: float | None

    @classmethod
    def of(cls, values, scale: float = 1.0) -> "Percentiles":
        if len(values) == 0:
            return cls(None, None, None, None, None)
        a = np.asarray(values, dtype=np.float64) * scale
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(a.max()), float(a.mean()))


@dataclass
class RunResult:
    label: str
    kind: str
    rate: float | None
    mode: str
    transport: str  # "in-process" (Engine.step from this process) or "http" (the server)
    num_requests: int
    finished: int
    wrong_length: int  # finished requests whose output length differs from the asked one
    incomplete: int  # requests not back whole: never sent or finished, cut, wrong length
    problems: list[str]  # the first MAX_PROBLEMS of them, one line each
    wall_s: float
    arrival_span_s: float
    prompt_tokens: int
    output_tokens: int
    output_tok_s: float
    total_tok_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    tpot_ms: Percentiles
    latency_s: Percentiles
    steps: int
    mean_batch: float | None
    mean_step_ms: float
    gpu_busy_frac: float | None
    gpu_iterations: int | None
    spec_acceptance: float | None
    triton_compiles_in_run: int
    engine: dict


def summarize(workload: Workload, mode: str, trace: RunTrace, stats_before: dict,
              stats_after: dict, gpu_ms: list[float] | None, compiles: int,
              transport: str = "in-process") -> RunResult:
    """One row of the report. Works for either driver: an HTTP run has no step series and
    its engine counters come from the server's /metrics (no batch mean there)."""
    reqs = list(trace.requests.values())
    done = [r for r in reqs if r.finish is not None]
    out_tokens = sum(r.tokens for r in reqs)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    engine = engine_counters(stats_before, stats_after)
    steps = engine.get("steps", len(trace.steps))
    wall = trace.wall
    problems = incomplete_requests(workload, trace.requests)
    suffix = "" if transport == "in-process" else f" {transport}"
    return RunResult(
        label=f"{workload.label} {mode}{suffix}", kind=workload.kind, rate=workload.rate,
        mode=mode, transport=transport, num_requests=len(workload.requests),
        finished=len(done), wrong_length=sum(r.tokens != r.asked for r in done),
        incomplete=len(problems), problems=problems[:MAX_PROBLEMS], wall_s=wall,
        arrival_span_s=max((r.arrival for r in reqs), default=0.0),
        prompt_tokens=prompt_tokens, output_tokens=out_tokens,
        output_tok_s=out_tokens / wall, total_tok_s=(out_tokens + prompt_tokens) / wall,
        ttft_ms=Percentiles.of([r.first_token - r.arrival for r in done], 1e3),
        itl_ms=Percentiles.of([g for r in reqs for g in r.itl], 1e3),
        tpot_ms=Percentiles.of([(r.finish - r.first_token) / (r.tokens - 1) for r in done
                                if r.tokens > 1], 1e3),
        latency_s=Percentiles.of([r.finish - r.arrival for r in done]),
        steps=steps, mean_batch=engine.get("mean_batch"),
        mean_step_ms=wall / max(steps, 1) * 1e3,
        gpu_busy_frac=None if gpu_ms is None else sum(gpu_ms) / 1e3 / wall,
        gpu_iterations=None if gpu_ms is None else len(gpu_ms),
        spec_acceptance=trace.accepted / trace.drafted if trace.drafted else None,
        triton_compiles_in_run=compiles, engine=engine)


def engine_counters(before: dict, after: dict) -> dict:
    """The run's share of stats_summary(): increases of the cumulative counters, the batch mean
    over the run's steps, and the rest (queue lengths, KV use) as of the run's end."""
    out = {k: v for k, v in after.items() if isinstance(v, (int, float))}
    for k in CUMULATIVE:
        if k in before and k in after:
            out[k] = after[k] - before[k]
    if {"steps", "mean_batch"} <= before.keys() & after.keys():
        rows = after["mean_batch"] * after["steps"] - before["mean_batch"] * before["steps"]
        out["mean_batch"] = rows / max(out["steps"], 1)
    return out


# -- the report ---------------------------------------------------------------------------------


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _quad(p: Percentiles, digits: int = 1) -> str:
    return " / ".join(_fmt(v, digits) for v in (p.p50, p.p90, p.p99, p.max))


def _hit_rate(engine: dict) -> str:
    """Prompt tokens whose KV a cached block held, over prompt tokens admitted."""
    query = engine.get("prefix_query_tokens")
    return "-" if not query else f"{engine.get('prefix_hit_tokens', 0) / query:.3f}"


def markdown(results: list[RunResult], meta: dict) -> str:
    commit = f"{meta['git_commit']}{' (with uncommitted changes)' if meta['git_dirty'] else ''}"
    lines = [f"Measured {meta['date']} on {meta['device']}, torch {meta['torch']}, model "
             f"{meta['model']}, commit {commit}. Command: `{meta['command']}`.", "",
             "TTFT from each request's scheduled arrival; ITL between host-visible token "
             "arrivals (a multi-token step's gap split evenly); GPU busy: each step's forward "
             "between CUDA events (decode iterations and mixed steps; a speculative engine's "
             "prefill not counted) over wall time; ms/step: wall / steps.", "",
             "| run | reqs | wall s | out tok/s | total tok/s | TTFT ms p50 / p90 / p99 / max "
             "| ITL ms p50 / p90 / p99 / max | latency s p50 / p99 | GPU busy "
             "| mean batch | steps | ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        busy = "-" if r.gpu_busy_frac is None else f"{100 * r.gpu_busy_frac:.1f}%"
        lines.append(
            f"| {r.label} | {r.num_requests} | {r.wall_s:.2f} | {r.output_tok_s:,.0f} | "
            f"{r.total_tok_s:,.0f} | {_quad(r.ttft_ms)} | {_quad(r.itl_ms, 2)} | "
            f"{_fmt(r.latency_s.p50, 2)} / {_fmt(r.latency_s.p99, 2)} | {busy} | "
            f"{_fmt(r.mean_batch)} | {r.steps} | {r.mean_step_ms:.2f} |")
    lines += ["", "| run | chain breaks | idle drains | pauses | evictions | spec acceptance "
              "| prefix hit rate | Triton compiles in run | wrong lengths | incomplete |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.engine
        acc = "-" if r.spec_acceptance is None else f"{r.spec_acceptance:.3f}"
        lines.append(f"| {r.label} | {e.get('chain_breaks', '-')} | {e.get('idle_drains', '-')} "
                     f"| {e.get('pauses', '-')} | {e.get('evictions', '-')} | {acc} | "
                     f"{_hit_rate(e)} | {r.triton_compiles_in_run} | {r.wrong_length} | "
                     f"{r.incomplete} |")
    pairs = http_vs_in_process(results)
    if pairs:
        lines += ["", "HTTP runs: the same requests through `python -m graphexec.serve` from "
                  "concurrent streaming clients, timed at SSE chunk arrival; engine counters "
                  "from its /metrics.", "",
                  "| run | in-process out tok/s | HTTP out tok/s | HTTP / in-process "
                  "| TTFT p50 ms in-process / HTTP | ITL p50 ms in-process / HTTP |",
                  "|---|---|---|---|---|---|"]
        for p in pairs:
            lines.append(
                f"| {p['run']} | {p['in_process_out_tok_s']:,.0f} | {p['http_out_tok_s']:,.0f} "
                f"| {p['out_tok_s_ratio']:.3f} | {_fmt(p['ttft_p50_ms'][0])} / "
                f"{_fmt(p['ttft_p50_ms'][1])} | {_fmt(p['itl_p50_ms'][0], 2)} / "
                f"{_fmt(p['itl_p50_ms'][1], 2)} |")
    return "\n".join(lines)


def http_vs_in_process(results: list[RunResult]) -> list[dict]:
    """Each HTTP run beside the in-process run of the same workload and mode."""
    local = {(r.kind, r.rate, r.mode): r for r in results if r.transport == "in-process"}
    out = []
    for h in results:
        r = local.get((h.kind, h.rate, h.mode)) if h.transport != "in-process" else None
        if r is None:
            continue
        out.append(dict(run=r.label, in_process_out_tok_s=r.output_tok_s,
                        http_out_tok_s=h.output_tok_s,
                        out_tok_s_ratio=h.output_tok_s / r.output_tok_s,
                        ttft_p50_ms=(r.ttft_ms.p50, h.ttft_ms.p50),
                        itl_p50_ms=(r.itl_ms.p50, h.itl_ms.p50)))
    return out


def plot(results: list[RunResult], series: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    label = _timeline_run(results)
    s = series[label]  # an HTTP run's series is empty: no steps seen from the client
    gpu = s["gpu_iter_ms"] is not None and len(s["gpu_iter_ms"]) > 0
    fig, axes = plt.subplots(1, 3 if gpu else 2, figsize=(17 if gpu else 12, 4.5))
    _plot_latency(axes[0], results)
    _plot_steps(axes[1], s, label)
    if gpu:
        ms, pre = np.asarray(s["gpu_iter_ms"]), np.asarray(s["gpu_iter_prefill"], dtype=bool)
        idx = np.arange(len(ms))
        axes[2].plot(idx, ms, ".", ms=2, label="decode iteration")
        axes[2].plot(idx[pre], ms[pre], "x", ms=4, label="launched with a prefill")
        axes[2].set(title=f"{label}: GPU ms per decode iteration", xlabel="iteration",
                    ylabel="ms")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _timeline_run(results: list[RunResult]) -> str:
    """The run whose steps are drawn: the first offline one (most churn), else the first;
    in-process runs first, as only they have a step series."""
    ranked = sorted(results, key=lambda r: r.transport != "in-process")
    return next((r.label for r in ranked if r.kind == "offline"), ranked[0].label)


def _plot_latency(ax, results: list[RunResult]) -> None:
    online = [r for r in results if r.kind == "online"]
    metrics = (("TTFT p50", lambda r: r.ttft_ms.p50, "o"),
               ("TTFT p99", lambda r: r.ttft_ms.p99, "^"),
               ("ITL p50", lambda r: r.itl_ms.p50, "s"),
               ("ITL p99", lambda r: r.itl_ms.p99, "v"))
    # colour: the metric; line style: the mode and transport
    for m, key in enumerate(sorted({(r.mode, r.transport) for r in online})):
        rs = sorted((r for r in online if (r.mode, r.transport) == key), key=lambda r: r.rate)
        rates = [r.rate for r in rs]
        for c, (name, get, marker) in enumerate(metrics):
            ax.plot(rates, [get(r) for r in rs], marker=marker,
                    ls=("-", "--", ":", "-.")[m % 4], color=f"C{c}",
                    label=f"{key[0]} {key[1]} {name}")
    ax.set(title="online: latency against request rate", xlabel="requests/s", ylabel="ms",
           xscale="log", yscale="log")
    if online:
        ax.legend(fontsize=7)


def _plot_steps(ax, s: dict, label: str) -> None:
    ax.plot(s["t_s"], s["step_ms"], ".", ms=2, color="C0")
    ax.set(title=f"{label}: host wall time per Engine.step", xlabel="s since start",
           ylabel="ms", yscale="log")
    if any(b is not None for b in s["batch"]):
        twin = ax.twinx()
        twin.plot(s["t_s"], [b or 0 for b in s["batch"]], "-", lw=0.8, color="C1")
        twin.set_ylabel("rows launched", color="C1")
