"""The mixed step: the decode rows and a step's prompt chunks in one forward.

A step that admits used to run the prefill step and then the decode iteration, each reading every
weight once: on llama-1b about 0.8 ms of weight streaming paid twice on every admitting step. Here
the decode rows ride in front of the chunks' tokens of the packed prefill batch (PrefillMeta,
num_decode of them), and every projection reads its weight once for both.

Attention splits by kind of row. The decode rows attend as the decode iteration attends them
(their own positions, slots and block tables read from DecodeState, through the decode-attention
op): the prefill kernel would run one program per row and head over the whole context, where
the decode kernel may split it (sized for AttentionTuning.mixed_split_rows rows: the decode
part's static size would mostly count inert places). The chunks attend through the prefill
attention, which sees the decode rows' places as tokens of no sequence writing the scratch
block.

A row whose last chunk runs in this step samples its first token from the chunk and decodes from
the next step on: the decode part covers rows [0, num_decode), the rows the batch held before this
step's chunks joined it (the scheduler appends joining rows after them). The decode part's size is
static (min(max_rows, token bucket), so one graph per token bucket serves every batch); its rows
past num_decode run as the inert row.
"""
from __future__ import annotations

import torch

from ..kernels.tuning import tuning_for
from ..model.llama import AttentionInputs, KVCache, LlamaModel
from .iteration import SampleOut, sample_rows
from .prefill import PrefillMeta
from .prompt_logprobs import prompt_logprobs
from .state import DecodeState

def mixed_step(model: LlamaModel, state: DecodeState, kv: KVCache, meta: PrefillMeta,
               decode_rows: int, block_size: int, with_logprobs: bool,
               draft=None, penalties: bool = False, grammar: bool = False,
               prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleOut:
    """Writes the chunks' KV, samples each chunk's next token from its last position and sets
    the joining rows' next input, position and step (returned: the chunks' samples); decodes
    rows [0, meta.num_decode) as the decode iteration does, their tokens where it leaves them
    (state.out_tokens and the logprob buffers). decode_rows: the static size of the decode
    part, at least num_decode and at most the token count; 0 for the prefill step alone (a
    speculative runner's, whose draft with a KV cache of its own writes it here too). Sizes
    come from tensors only: captured as it is (capture/graphs.py)."""
    r = decode_rows
    ids, positions = meta.ids, meta.positions
    attn = AttentionInputs(slot_mapping=meta.slots,
                           block_tables=meta.block_tables.to(torch.int32),
                           seq_lens=meta.seq_lens.to(torch.int32),
                           cu_seqlens_q=meta.cu_seqlens.to(torch.int32))
    # each chunk's last token (an empty pad sequence picks any token: its sample is unused)
    last = meta.cu_seqlens[1:] - 1
    rows, steps, samples = meta.rows, meta.steps, meta.samples
    next_input, next_position = meta.resume, meta.next_position
    if r:
        index = torch.arange(r, device=ids.device)
        live = index < meta.num_decode
        rows_dec = torch.where(live, index, state.inert_row)
        pos_dec = state.positions[rows_dec]
        tables_dec = state.block_tables[rows_dec]
        slots_dec, lens_dec = model.ops.decode_metadata(pos_dec, tables_dec, block_size)
        ids = torch.cat([torch.where(live, state.input_ids[rows_dec], ids[:r]), ids[r:]])
        positions = torch.cat([torch.where(live, pos_dec, positions[:r]), positions[r:]])
        split_rows = tuning_for(ids.device).attention.mixed_split_rows
        attn.decode = AttentionInputs(
            slot_mapping=slots_dec, block_tables=tables_dec, seq_lens=lens_dec,
            rows_are_sequences=True, split_rows=min(r, split_rows) if split_rows else None)
        attn.decode_mask = live
        # Decode rows move on by their token; the inert row (every unused place) is
        # rewritten with its own zeros.
        last = torch.cat([index, last])
        rows = torch.cat([rows_dec, rows])
        steps = torch.cat([state.steps[rows_dec], steps])
        samples = torch.cat([live.long(), samples])
        next_input = torch.cat([torch.zeros_like(pos_dec), next_input])
        next_position = torch.cat([torch.where(live, pos_dec + 1, 0), next_position])
    hidden = model.forward(ids, positions, attn, kv)
    if draft is not None and not draft.shares_target_kv:
        draft.model.forward(ids, positions, attn, draft.kv)  # the draft's own KV
    logits = model.compute_logits(hidden.rows(last))
    prompt = None
    if prompt_rows is not None:  # (packed positions, the prompt tokens after them)
        prompt = prompt_logprobs(model, hidden, *prompt_rows, state.out_top_ids.shape[-1])
    state.steps[rows] = steps
    # penalties: the joining rows' slots were filled by this step's delta, before it
    out = sample_rows(model, state, rows, logits, with_logprobs,
                      samples.bool() if penalties else None, grammar)
    # New rows continue from their first sampled token, resumed ones from their last token.
    state.input_ids[rows] = torch.where(samples.bool(), out.tokens, next_input)
    state.positions[rows] = next_position
    state.steps[rows] = steps + samples
    out.prompt = prompt
    if not r:
        return out
    state.out_tokens[:r, 0] = out.tokens[:r]
    if not with_logprobs:
        return SampleOut(out.tokens[r:], prompt=prompt)
    state.out_logprob[:r, 0] = out.logprob[:r]
    state.out_top_logprobs[:r, 0] = out.top_logprobs[:r]
    state.out_top_ids[:r, 0] = out.top_ids[:r]
    return SampleOut(out.tokens[r:], out.logprob[r:], out.top_logprobs[r:], out.top_ids[r:],
                     prompt)
