"""LLM: the offline batch API over an Engine."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

from .text.chat import encode_chat, validate_conversation
from .engine import Engine
from .data_parallel import ReplicaPool
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, data_parallel_size: int = 1, **options):
        """data_parallel_size > 1: that many engines, each in a process of its own on GPUs of
        its own (graphexec/data_parallel.py), sharing out every batch; self.engine is None."""
        self._counter = 0
        self._pool = None
        if data_parallel_size == 1:
            self.engine = Engine(model, **options)
            self._tokenizer = self.engine.tokenizer
        else:
            self.engine = None
            self._pool = ReplicaPool(model, options, data_parallel_size)
            self._tokenizer = self._pool.tokenizer

    def close(self) -> None:
        """Frees the engine's device memory now (see Engine.close)."""
        if self._pool is not None:
            self._pool.close()
        else:
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
        if self._pool is not None:
            outputs = self._pool.generate(list(prompts), params)
            for out in outputs:  # each replica counts its own; ids stay unique here
                out.request_id = f"gen-{self._counter}"
                self._counter += 1
            return outputs
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
        # With a tokenizer each output carries the streamed text, stop strings already cut.
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, **template_vars) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation (a list of {"role", "content"}
        dicts) or to each of a list of conversations; outputs in the conversations' order."""
        tok = self._tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if (isinstance(messages, Sequence) and not isinstance(messages, (str, bytes))
                and messages and isinstance(messages[0], dict)):
            messages = [messages]  # one conversation
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) \
                or not messages:
            raise ValueError(f"messages must be a conversation (a list of {{'role', 'content'}} "
                             f"dicts) or a list of them, got {messages!r}")
        prompts = []
        for i, conv in enumerate(messages):
            validate_conversation(conv, f"messages[{i}]" if len(messages) > 1 else "messages")
            prompts.append(encode_chat(tok, conv, add_generation_prompt, chat_template,
                                       **template_vars))
        return self.generate(prompts, params, use_tqdm=use_tqdm)
