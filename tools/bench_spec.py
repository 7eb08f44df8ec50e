"""Speculative decoding benchmark (`python tools/bench.py spec`).

Random weights make acceptance meaningless unless it is controlled, so two set-ups, both with
the llama-8b preset as target, greedy, prompt 128 + 128 new tokens:

- overhead: draft = the whole target (self:32). Every draft is accepted and nothing is gained:
  tokens/s against plain decode is the cost of the machinery.
- speed-up: the layers after the 4th are damped (their o_proj and down_proj scaled down, so
  they add little to the residual stream but every weight is still read at full cost) and the
  draft is self:4. Plain decode reads the same bytes, so the plain run is the baseline for both.

Decode tokens/s counts the tokens emitted after the prefill step over the GPU span from the
first decode iteration's start to the last one's end (CUDA events), so prefill, which is the
same for every set-up, does not dilute the comparison; end-to-end tokens/s is reported too.
"""
from __future__ import annotations

import json
import time

import torch

from graphexec import LLM, SamplingParams, SpeculativeConfig
from graphexec.model import preset

TARGET = "llama-8b"
DAMP_AFTER, DAMP_SCALE = 4, 1e-3


def _run(llm: LLM, batch: int, async_mode: bool, prompt_len: int, new: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    engine.config.async_scheduling = async_mode  # the loop reads it every step
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    greedy = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    runner.timeline = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    timeline, runner.timeline = runner.timeline, None
    span = timeline[0][0].elapsed_time(timeline[-1][1]) / 1e3
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.num_drafted_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    return dict(batch=batch, mode="async" if async_mode else "sync", e2e_tokens_per_s=tokens / wall,
                decode_tokens_per_s=(tokens - batch) / span, iterations=len(timeline),
                acceptance=accepted / drafted if drafted else None,
                tokens_per_iteration=(tokens - batch) / max(len(timeline), 1) / batch)


def _engine(spec: SpeculativeConfig | None, batches: list[int], max_len: int,
            batch_invariant: bool, projections: str) -> LLM:
    blocks = max(batches) * -(-(max_len + 8) // 16) + 16
    return LLM(TARGET, max_batch=max(batches), buckets=sorted(set(batches)),
               max_model_len=max_len, num_kv_blocks=blocks, speculative=spec,
               batch_invariant=batch_invariant, projections=projections)


def _damp(llm: LLM) -> None:
    for layer in llm.engine.model.weights.layers[DAMP_AFTER:]:
        layer.o.mul_(DAMP_SCALE)
        layer.down.mul_(DAMP_SCALE)


def bench_spec(path: str, batches=(1, 16, 64), ks=(1, 2, 4), prompt_len: int = 128,
               new: int = 128, batch_invariant: bool = False, projections: str = "auto",
               only: list[str] | None = None) -> list[dict]:
    """batch_invariant: every set-up (plain too) on the batch-invariant kernels. only: run the
    set-ups whose names start with one of these (plain always runs: the others are relative
    to it)."""
    max_len = prompt_len + new + 16
    n_layers = preset(TARGET).num_layers
    setups = [("plain", None, False)]
    setups += [(f"overhead self:{n_layers} K={k}", SpeculativeConfig(f"self:{n_layers}", k), False)
               for k in ks]
    setups += [(f"speed-up self:{DAMP_AFTER} K=4 (damped)", SpeculativeConfig(f"self:{DAMP_AFTER}", 4),
                True)]
    if only:
        setups = [st for st in setups if st[0] == "plain" or st[0].startswith(tuple(only))]
    rows = []
    for name, spec, damped in setups:
        llm = _engine(spec, list(batches), max_len, batch_invariant, projections)
        if damped:
            _damp(llm)
        for batch in batches:
            for async_mode in (False, True):
                res = dict(setup=name, batch_invariant=batch_invariant,
                           **_run(llm, batch, async_mode, prompt_len, new))
                print(json.dumps(res), flush=True)
                rows.append(res)
        llm.close()
        del llm
    plain = {(r["batch"], r["mode"]): r["decode_tokens_per_s"] for r in rows
             if r["setup"] == "plain"}
    for r in rows:
        r["vs_plain"] = r["decode_tokens_per_s"] / plain[(r["batch"], r["mode"])]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Target {TARGET}, greedy, 128 + 128 tokens, on {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}. Command: `{command}`.", "",
             "| set-up | batch | mode | decode tok/s | vs plain | e2e tok/s | acceptance |"
             " tokens/row/iteration |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        lines.append(f"| {r['setup']} | {r['batch']} | {r['mode']} | "
                     f"{r['decode_tokens_per_s']:,.0f} | {r['vs_plain']:.2f}x | "
                     f"{r['e2e_tokens_per_s']:,.0f} | {acc} | {r['tokens_per_iteration']:.2f} |")
    return "\n".join(lines)
