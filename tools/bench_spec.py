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

Controls (`python tools/bench_spec.py controls`): the damped speed-up set-up and plain decode on
batches of plain, penalised (presence, frequency, repetition, logit bias), grammar (a regex that
never completes, over a made-up vocabulary: every row runs to max_tokens) and mixed rows (half
grammar, half plain), all greedy. Grammar rows take no drafts (capture/spec_controls.py), so
their tokens per row and iteration is 1 and every step waits for the host's masks:

    python tools/bench_spec.py controls --batches 1 16 64 --out spec_controls.json
    python tools/bench_spec.py controls --target tiny --draft self:1 --damp-after 1 \
        --device cpu --batches 4 --new 32          # the CPU's acceptance figures
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from graphexec import LLM, SamplingParams, SpeculativeConfig
from graphexec.model import preset

TARGET = "llama-8b"
DAMP_AFTER, DAMP_SCALE = 4, 1e-3


def _run(llm: LLM, batch: int, async_mode: bool, prompt_len: int, new: int,
         params: list[SamplingParams] | None = None) -> dict:
    """params: one per row (default: greedy, ignore_eos). Off CUDA the decode span is the
    wall time (prefill included)."""
    engine, runner = llm.engine, llm.engine.runner
    engine.config.async_scheduling = async_mode  # the loop reads it every step
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()
    if params is None:
        params = [SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)] * batch
    cuda = engine.config.device.type == "cuda"
    llm.generate(prompts, [dataclasses.replace(p, max_tokens=4) for p in params])  # warm-up
    if cuda:
        torch.cuda.synchronize()
        runner.timeline = []
    steps, waits = engine.stats.steps, engine.stats.grammar_waits
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    timeline, runner.timeline = runner.timeline or [], None
    span = timeline[0][0].elapsed_time(timeline[-1][1]) / 1e3 if timeline else wall
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.num_drafted_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    # off CUDA: the steps, less a plain engine's first (its prefill's mixed step)
    iterations = len(timeline) or engine.stats.steps - steps - (0 if runner.k else 1)
    return dict(batch=batch, mode="async" if async_mode else "sync", e2e_tokens_per_s=tokens / wall,
                decode_tokens_per_s=(tokens - batch) / span, iterations=len(timeline),
                acceptance=accepted / drafted if drafted else None,
                tokens_per_iteration=(tokens - batch) / max(iterations, 1) / batch,
                grammar_waits=engine.stats.grammar_waits - waits)


def _engine(spec: SpeculativeConfig | None, batches: list[int], max_len: int,
            batch_invariant: bool, projections: str, target: str = TARGET, **opts) -> LLM:
    blocks = max(batches) * -(-(max_len + 8) // 16) + 16
    return LLM(target, max_batch=max(batches), buckets=sorted(set(batches)),
               max_model_len=max_len, num_kv_blocks=blocks, speculative=spec,
               batch_invariant=batch_invariant, projections=projections, **opts)


def _damp(llm: LLM, after: int = DAMP_AFTER) -> None:
    for layer in llm.engine.model.weights.layers[after:]:
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


def _acceptance(r: dict) -> str:
    return f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"


# (header, cell) of every table column the two set-ups share or add
_COLUMNS = dict(
    setup=("set-up", lambda r: r["setup"]), rows=("rows", lambda r: r["rows"]),
    batch=("batch", lambda r: str(r["batch"])), mode=("mode", lambda r: r["mode"]),
    decode=("decode tok/s", lambda r: f"{r['decode_tokens_per_s']:,.0f}"),
    vs=("vs plain", lambda r: f"{r['vs_plain']:.2f}x"),
    e2e=("e2e tok/s", lambda r: f"{r['e2e_tokens_per_s']:,.0f}"),
    acceptance=("acceptance", _acceptance),
    per_iteration=("tokens/row/iteration", lambda r: f"{r['tokens_per_iteration']:.2f}"),
    waits=("grammar waits", lambda r: str(r["grammar_waits"])))


def _table(rows: list[dict], columns: list[str]) -> list[str]:
    cols = [_COLUMNS[c] for c in columns]
    return ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(cell(r) for _, cell in cols) + " |" for r in rows]


def markdown(rows: list[dict], command: str) -> str:
    return "\n".join([f"Target {TARGET}, greedy, 128 + 128 tokens, on "
                      f"{torch.cuda.get_device_name()}, torch {torch.__version__}. "
                      f"Command: `{command}`.", ""] + _table(rows, [
                          "setup", "batch", "mode", "decode", "vs", "e2e", "acceptance",
                          "per_iteration"]))


# -- controls: penalised and grammar rows under speculation -----------------------------------

ROW_KINDS = ("plain", "penalised", "grammar", "mixed")
# never completes ('!' is in no token of the made-up vocabulary): rows run to max_tokens
NEVER_ENDS = "[a-z ]*!"


def _made_up_grammars(llm: LLM) -> None:
    """A grammar compiler over a made-up vocabulary (the random-weight presets have no
    tokenizer): token i spells a run of one character (tests/test_lifecycle_state_machine.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from graphexec.structured import Grammars
    from test_lifecycle_state_machine import _tiny_vocab

    mc = llm.engine.model_config
    eos = list(mc.eos_token_ids)
    llm.engine._grammars = Grammars.for_vocab(_tiny_vocab(mc.vocab_size, eos), eos)


def _row_params(kind: str, batch: int, new: int) -> list[SamplingParams]:
    from graphexec.structured import StructuredOutputsParams

    plain = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True,
                               presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.1, logit_bias={100: 1.0, 200: -1.0})
    grammar = SamplingParams(max_tokens=new, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex=NEVER_ENDS))
    if kind == "mixed":
        return [grammar if i % 2 else plain for i in range(batch)]
    return [dict(plain=plain, penalised=penalised, grammar=grammar)[kind]] * batch


def bench_controls(path: str, batches=(1, 16, 64), kinds=ROW_KINDS, prompt_len: int = 128,
                   new: int = 128, target: str = TARGET, draft: str = f"self:{DAMP_AFTER}",
                   k: int = 4, damp_after: int = DAMP_AFTER, device: str | None = None,
                   modes=(False, True)) -> list[dict]:
    """Plain decode and speculation (the damped target, `draft`, K) on each kind of rows."""
    max_len = prompt_len + new + 16
    opts = dict(device=device) if device else {}
    rows = []
    for name, spec in (("plain", None), (f"spec {draft} K={k}", SpeculativeConfig(draft, k))):
        llm = _engine(spec, list(batches), max_len, False, "auto", target, **opts)
        _damp(llm, damp_after)
        _made_up_grammars(llm)
        for kind in kinds:
            for batch in batches:
                for async_mode in modes:
                    res = dict(setup=name, rows=kind, **_run(
                        llm, batch, async_mode, prompt_len, new, _row_params(kind, batch, new)))
                    print(json.dumps(res), flush=True)
                    rows.append(res)
        llm.close()
        del llm
    plain = {(r["rows"], r["batch"], r["mode"]): r["decode_tokens_per_s"] for r in rows
             if r["setup"] == "plain"}
    for r in rows:
        r["vs_plain"] = r["decode_tokens_per_s"] / plain[(r["rows"], r["batch"], r["mode"])]
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def controls_markdown(rows: list[dict], command: str) -> str:
    return "\n".join([f"Command: `{command}`.", ""] + _table(rows, [
        "setup", "rows", "batch", "mode", "decode", "vs", "acceptance", "per_iteration",
        "waits"]))


def main() -> None:
    ap = argparse.ArgumentParser(description="speculative decoding with penalised and "
                                             "grammar rows (the module's docstring)")
    ap.add_argument("what", choices=["controls"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--rows", nargs="+", default=list(ROW_KINDS), choices=list(ROW_KINDS))
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=f"self:{DAMP_AFTER}")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--damp-after", type=int, default=DAMP_AFTER)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--async-only", action="store_true")
    ap.add_argument("--out", default="spec_controls.json")
    args = ap.parse_args()
    rows = bench_controls(args.out, args.batches, args.rows, args.prompt_len, args.new,
                          args.target, args.draft, args.k, args.damp_after, args.device,
                          (True,) if args.async_only else (False, True))
    print(controls_markdown(rows, "python tools/bench_spec.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
