"""The serving benchmark's report (tools/bench_serve.py): the markdown tables and the plot."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench_serve import Percentiles, RunResult


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _quad(p: Percentiles, digits: int = 1) -> str:
    return " / ".join(_fmt(v, digits) for v in (p.p50, p.p90, p.p99, p.max))


def markdown(results: list[RunResult], meta: dict) -> str:
    commit = f"{meta['git_commit']}{' (with uncommitted changes)' if meta['git_dirty'] else ''}"
    lines = [f"Measured {meta['date']} on {meta['device']}, torch {meta['torch']}, model "
             f"{meta['model']}, commit {commit}. Command: `{meta['command']}`.", "",
             "TTFT from each request's scheduled arrival; ITL between host-visible token "
             "arrivals (a multi-token step's gap split evenly); GPU decode busy: decode "
             "iterations only (prefill not counted) over wall time; ms/step: wall / steps.", "",
             "| run | reqs | wall s | out tok/s | total tok/s | TTFT ms p50 / p90 / p99 / max "
             "| ITL ms p50 / p90 / p99 / max | latency s p50 / p99 | GPU decode busy "
             "| mean batch | steps | ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        busy = "-" if r.gpu_decode_busy_frac is None else f"{100 * r.gpu_decode_busy_frac:.1f}%"
        lines.append(
            f"| {r.label} | {r.num_requests} | {r.wall_s:.2f} | {r.output_tok_s:,.0f} | "
            f"{r.total_tok_s:,.0f} | {_quad(r.ttft_ms)} | {_quad(r.itl_ms, 2)} | "
            f"{_fmt(r.latency_s.p50, 2)} / {_fmt(r.latency_s.p99, 2)} | {busy} | "
            f"{_fmt(r.mean_batch)} | {r.steps} | {r.mean_step_ms:.2f} |")
    lines += ["", "| run | chain breaks | idle drains | pauses | evictions | spec acceptance "
              "| Triton compiles in run | wrong lengths |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        e = r.engine
        acc = "-" if r.spec_acceptance is None else f"{r.spec_acceptance:.3f}"
        lines.append(f"| {r.label} | {e.get('chain_breaks', '-')} | {e.get('idle_drains', '-')} "
                     f"| {e.get('pauses', '-')} | {e.get('evictions', '-')} | {acc} | "
                     f"{r.triton_compiles_in_run} | {r.wrong_length} |")
    return "\n".join(lines)


def plot(results: list[RunResult], series: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    label = _timeline_run(results)
    s = series[label]
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
    """The run whose steps are drawn: the first offline one (most churn), else the first."""
    return next((r.label for r in results if r.kind == "offline"), results[0].label)


def _plot_latency(ax, results: list[RunResult]) -> None:
    online = [r for r in results if r.kind == "online"]
    metrics = (("TTFT p50", lambda r: r.ttft_ms.p50, "o"),
               ("TTFT p99", lambda r: r.ttft_ms.p99, "^"),
               ("ITL p50", lambda r: r.itl_ms.p50, "s"),
               ("ITL p99", lambda r: r.itl_ms.p99, "v"))
    # colour: the metric; line style: the mode
    for m, mode in enumerate(sorted({r.mode for r in online})):
        rs = sorted((r for r in online if r.mode == mode), key=lambda r: r.rate)
        rates = [r.rate for r in rs]
        for c, (name, get, marker) in enumerate(metrics):
            ax.plot(rates, [get(r) for r in rs], marker=marker, ls=("-", "--", ":")[m % 3],
                    color=f"C{c}", label=f"{mode} {name}")
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
