"""Prompt logprobs: each prompt token's logprob given the tokens before it, with the top 20, for
the chunks of requests that ask (SamplingParams.prompt_logprobs). Such a step runs eagerly (its
rows are not a captured shape) and its results go back through pinned memory of their own,
copied behind the step, before the step's event (graphexec/runner.py)."""
from __future__ import annotations

import torch

from ..model.llama import FinalHidden, LlamaModel

# Positions whose logits exist at once: a 1024-token chunk at a vocabulary of 128k would
# otherwise hold 512 MiB of fp32 log-softmax.
ROWS_AT_ONCE = 256


def prompt_logprobs(model: LlamaModel, hidden: FinalHidden, rows: torch.Tensor,
                    targets: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """(chosen [P], top values [P, n], top ids [P, n]) of the token at targets[i] after the
    packed position rows[i], from the model's raw distribution."""
    parts = []
    for i in range(0, rows.shape[0], ROWS_AT_ONCE):
        logits = model.compute_logits(hidden.rows(rows[i:i + ROWS_AT_ONCE]))
        parts.append(model.ops.logprobs(logits, targets[i:i + ROWS_AT_ONCE], n))
    return tuple(torch.cat(x) for x in zip(*parts))


def pack_rows(chunks, lead: int) -> tuple[list[int], list[int]]:
    """The packed positions (after `lead` decode rows) whose next token's logprob the chunks
    ask for, and those tokens."""
    rows, targets, at = [], [], lead
    for c in chunks:
        t = c.logprob_targets or []
        rows += range(at, at + len(t))
        targets += t
        at += len(c.token_ids)
    return rows, targets


def to_pinned(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Enqueues the copy of each to pinned host memory (a plain copy on the CPU)."""
    if values[0].device.type != "cuda":
        return values
    out = []
    for v in values:
        host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        host.copy_(v, non_blocking=True)
        out.append(host)
    return tuple(out)
