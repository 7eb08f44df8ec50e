"""The decode iteration: forward one token per row, sample, advance the state. Everything reads
and writes DecodeState, so one call can be captured as a CUDA graph and replayed with no host
input while the batch is unchanged."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.llama import AttentionInputs, KVCache, LlamaModel
from ..plan import Variant
from .state import DecodeState


@dataclass
class SampleOut:
    tokens: torch.Tensor  # [n]
    logprob: torch.Tensor | None = None  # [n] chosen token's logprob
    top_logprobs: torch.Tensor | None = None  # [n, 20]
    top_ids: torch.Tensor | None = None  # [n, 20]
    prompt: tuple[torch.Tensor, ...] | None = None  # prompt logprobs (capture/prompt_logprobs.py)


def sample_rows(model: LlamaModel, state: DecodeState, rows: torch.Tensor | slice,
                logits: torch.Tensor, with_logprobs: bool,
                live: torch.Tensor | None = None, grammar: bool = False) -> SampleOut:
    """Samples one token for each of `rows` (a slice for decode, an index tensor for prefill)
    with the sampling parameters and RNG counters those rows hold. live: for a step of the
    penalties variant, which rows really sample (bool); their tokens are counted into their
    penalty slots. None: no penalties. grammar: apply the rows' token masks first."""
    ops = model.ops
    steps = state.steps[rows]
    # Logprobs are of the raw distribution: keep the unmasked logits only when they are asked.
    masked = ops.mask_stop_tokens(logits, state.stop_ids[rows], steps, state.min_tokens[rows],
                                  inplace=not with_logprobs)
    if grammar:
        if state.mask_gate is not None:  # the host fills the masks while the forward runs
            state.mask_gate.pull()
        ops.apply_token_mask(masked, state.token_mask[rows], state.mask_on[rows])
    temperature = state.temperature[rows]
    pen = state.penalties
    if live is not None:
        slots = state.penalty_slots[rows]
        ops.apply_logit_bias(masked, slots, pen.bias_ids, pen.bias_vals)
        ops.apply_penalties(masked, slots, pen.counts, pen.flags, pen.seen_ids, pen.num_seen,
                            pen.presence, pen.frequency, pen.repetition)
        ops.apply_min_p(masked, slots, temperature, pen.log_min_p)
    tokens = ops.sample(masked, temperature, state.top_k[rows], state.top_p[rows],
                        state.seeds[rows], steps)
    if live is not None:
        ops.count_tokens(pen.counts, pen.flags, pen.seen_ids, pen.num_seen, slots, tokens, live)
    if not with_logprobs:
        return SampleOut(tokens)
    chosen, top_vals, top_ids = ops.logprobs(logits, tokens, state.out_top_ids.shape[-1])
    return SampleOut(tokens, chosen, top_vals, top_ids)


def decode_iteration(model: LlamaModel, state: DecodeState, kv: KVCache, bucket: int,
                     block_size: int, variant: Variant) -> None:
    rows = slice(0, bucket)
    ops = model.ops
    slots, seq_lens = ops.decode_metadata(state.positions[rows], state.block_tables[rows],
                                          block_size)
    attn = AttentionInputs(slot_mapping=slots, block_tables=state.block_tables[rows],
                           seq_lens=seq_lens, rows_are_sequences=True)
    hidden = model.forward(state.input_ids[rows], state.positions[rows], attn, kv)
    logits = model.compute_logits(hidden)
    live = None
    if variant.penalties:  # the rows the advance moves on (padding rows hold slot 0 anyway)
        live = torch.arange(bucket, device=logits.device) < state.num_rows
    out = sample_rows(model, state, rows, logits, variant.logprobs, live, variant.grammar)
    if variant.logprobs:
        state.out_logprob[rows, 0] = out.logprob
        state.out_top_logprobs[rows, 0] = out.top_logprobs
        state.out_top_ids[rows, 0] = out.top_ids
    # Advance live rows only; padding rows stay inert (position 0, scratch block). The advance
    # also stores the tokens into the step's output (no copy launch of its own).
    ops.advance(out.tokens, state.input_ids[rows], state.positions[rows], state.steps[rows],
                state.num_rows, sampled_out=state.out_tokens[rows, 0])
