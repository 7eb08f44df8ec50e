"""LLM: the offline batch API over an Engine."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **options):
        self.engine = Engine(model, **options)
        self._counter = 0

    def close(self) -> None:
        """Frees the engine's device memory now (see Engine.close)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Sequence[list[int] | str] | list[int] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order. A prompt
        that fails validation raises before anything runs, naming the prompt."""
        if (isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1
                or (len(prompts) and isinstance(prompts[0], numbers.Integral))):
            prompts = [prompts]  # one prompt: a string, a list of ids or a 1-D array
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, p)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        wanted = set(ids)
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        tok = engine.tokenizer
        results = [done[rid] for rid in ids]
        if tok is not None:
            for r in results:
                r.text = tok.decode(r.token_ids)
        return results
