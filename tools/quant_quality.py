"""What quantization costs in quality: a model's next-token distributions over a text with its
weights (and optionally its KV cache) quantized, against the same model unquantized: top-1
agreement and the mean KL divergence KL(dense || quantized) per position. fp32 on the CPU, the
reference kernels, one prefill over the whole text. Prints a markdown table.

    python tools/quant_quality.py [--model smollm2-135m] [--tokens 400] [--group-size 64]

int4 groups must divide every projection's input dim: SmolLM2-135M's hidden size (576) is not a
multiple of 128, so its int4 rows use --group-size (default 64).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from graphexec.kernels import REFERENCE_OPS, quantized_ops  # noqa: E402
from graphexec.model import LlamaModel, load_model, resolve_model  # noqa: E402
from graphexec.model.llama import AttentionInputs, KVCache  # noqa: E402
from graphexec.model.quantize import is_quantized, quantize_weights, weight_bytes  # noqa: E402
from graphexec.text.tokenizer import load_tokenizer  # noqa: E402

CPU = torch.device("cpu")


def _text_ids(source, tokens: int) -> list[int]:
    """The first `tokens` tokens of docs/architecture.md (plain English prose and tables)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    ids = load_tokenizer(source).encode(text)
    return ids[:tokens]


def w8a8_ops():
    """The reference set with fp8 projections as the GPU runs them from
    QuantLinearTuning.fp8_scaled_mm_min_rows rows (a prefill's): the activations quantized per
    row too (kernels/linear_fp8_rows.py)."""
    from graphexec.kernels import linear_fp8_rows as w8a8
    from graphexec.kernels.quant_ops import QuantizedOps

    return QuantizedOps(REFERENCE_OPS, w8a8.linear_fp8_rows_ref, w8a8.norm_linear_fp8_rows_ref,
                        w8a8.silu_mul_linear_fp8_rows_ref).ops()


def logits_over(source, ids: list[int], method: str | None, group_size: int,
                kv_dtype: torch.dtype, activations_fp8: bool = False
                ) -> tuple[torch.Tensor, int]:
    """[T, vocab] fp32 logits of one causal prefill over ids, and the weights' bytes.
    activations_fp8: fp8 weights run W8A8 (w8a8_ops)."""
    mc, weights = load_model(source, CPU, torch.float32)
    weights = quantize_weights(weights, method, group_size)
    ops = quantized_ops(REFERENCE_OPS, CPU) if is_quantized(weights) else REFERENCE_OPS
    if activations_fp8:
        ops = w8a8_ops()
    model = LlamaModel(mc, weights, ops, max_positions=len(ids) + 1)
    bs, n = 16, len(ids)
    blocks = -(-n // bs)
    shape = (blocks, bs, mc.num_kv_heads, mc.head_dim)
    kv = KVCache([torch.zeros(shape, dtype=kv_dtype) for _ in range(mc.num_layers)],
                 [torch.zeros(shape, dtype=kv_dtype) for _ in range(mc.num_layers)])
    t = torch.tensor
    attn = AttentionInputs(slot_mapping=torch.arange(n), block_tables=torch.arange(blocks)[None]
                           .int(), seq_lens=t([n]).int(), cu_seqlens_q=t([0, n]).int())
    with torch.no_grad():
        hidden = model.forward(t(ids), torch.arange(n), attn, kv)
        return model.compute_logits(hidden).float(), weight_bytes(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    ids = _text_ids(source, args.tokens)
    fp8_kv = torch.float8_e4m3fn
    runs = [("none", None, torch.float32), ("fp8", "fp8", torch.float32),
            ("fp8, W8A8 (activations per row too)", "fp8", torch.float32),
            (f"int4 g{args.group_size}", "int4", torch.float32),
            (f"int4_asym g{args.group_size}", "int4_asym", torch.float32),
            ("none, fp8 KV", None, fp8_kv), ("fp8, fp8 KV", "fp8", fp8_kv)]
    dense, _ = logits_over(source, ids, None, args.group_size, torch.float32)
    log_p = torch.log_softmax(dense, -1)
    print(f"{args.model}, {len(ids)} tokens of docs/architecture.md, fp32 on the CPU, "
          "against the unquantized model\n")
    print("| weights | top-1 agreement | mean KL (nats) | weight bytes |")
    print("|---|---|---|---|")
    for name, method, kv_dtype in runs:
        logits, nbytes = logits_over(source, ids, method, args.group_size, kv_dtype,
                                     activations_fp8="W8A8" in name)
        log_q = torch.log_softmax(logits, -1)
        agree = (logits.argmax(-1) == dense.argmax(-1)).float().mean().item()
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
        print(f"| {name} | {agree:.3f} | {kl:.4f} | {nbytes / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
