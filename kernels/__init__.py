"""Kernels and their PyTorch references. `select_ops(device)` is the one dispatch point: Triton
kernels on CUDA when available, the references everywhere else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import advance, attention, linear, penalties, rmsnorm, rope, sampling, token_mask
from .tuning import tuning_for


@dataclass(frozen=True)
class Ops:
    """An op set: the kernels the model (through graphexec/model/layer_ops.py) and the captured
    steps (capture/) call. REFERENCE_OPS below; the Triton sets come from
    triton_ops.op_set, their projection policy from kernels/op_sets.py."""
    name: str
    rms_norm: Callable
    rope_write_kv: Callable  # rotary embedding + the KV-cache write in one pass
    decode_attention: Callable
    prefill_attention: Callable
    sample: Callable
    argmax: Callable  # [N, V] -> int64 [N], first index of the maximum (greedy, speculation)
    mask_stop_tokens: Callable
    logprobs: Callable
    decode_metadata: Callable
    advance: Callable
    spec_advance: Callable  # a speculative iteration's output and advance (kernels/advance.py)
    linear: Callable  # the projections: (x, weight, bias) -> x @ weight.T + bias
    norm_linear: Callable  # (x, residual, norm_w, eps, weight, bias) -> (proj(norm), sum)
    silu_mul_linear: Callable  # (gate_up, weight, bias) -> proj(silu(gate) * up)
    # A layer's two projections whose outputs join the residual stream, composed by the kernel
    # set (the add in their epilogue rather than the next norm's prologue): both return
    # (h, residual), the stream being h + residual, or h alone when residual is None. Each is
    # told the weight of the norm that follows it (None after the last layer), whose work it
    # may begin: h is then the op set's own type (linear_fused_triton.Prenormed), which only its
    # norm_linear and mlp read. None: LayerOps composes linear, norm_linear and
    # silu_mul_linear, leaving each add to the next norm.
    out_linear: Callable | None = None  # (x, weight, residual, next_norm_w) -> (h, residual)
    # (x, residual, norm_w, eps, gate_up, down, next_norm_w) -> (h, residual)
    mlp: Callable | None = None
    # A rank set's out_linear and mlp also take push= (an all_reduce_triton.Push or None):
    # where their projection runs on Triton, it sends its partial sum to the peers from its
    # epilogue and h comes back as a Pushed.
    # rope_write_kv + decode_attention in one op, for decode batches whose rows are distinct
    # sequences; None: the model calls the two.
    rope_decode_attention: Callable | None = None
    # rank -> the set for that tensor-parallel rank (its rank_set True), whose out_linear and
    # mlp return partial sums without the residual (passed through) for the model to
    # all-reduce, and whose norm_linear and mlp also take a Normed; None: a sharded model drops
    # out_linear and mlp and composes the plain projections.
    for_rank: Callable[[int], "Ops"] | None = None
    rank_set: bool = False
    # Takes the projection weights in the order a decode forward launches them, for a set that
    # warms L2 with the next projection's weight (kernels/weight_order.py); None: no such set.
    link_weights: Callable[[list[torch.Tensor]], None] | None = None
    # Whether a sharded model may let the all-reduce also do the next residual add and norm
    # (Shard.all_reduce_norm). It takes that path only for messages that fit its kernel, and
    # its norm sums the squares in another order than the norm kernel, so a row's bits would
    # depend on the step's token count: a batch-invariant set says no.
    all_reduce_norm: bool = True
    # Penalties, logit bias and min_p, and the token counts they read (kernels/penalties.py):
    # only the steps of the `penalties` variant call them.
    apply_logit_bias: Callable = penalties.apply_logit_bias_ref
    apply_penalties: Callable = penalties.apply_penalties_ref
    apply_min_p: Callable = penalties.apply_min_p_ref
    count_tokens: Callable = penalties.count_tokens_ref
    apply_token_mask: Callable = token_mask.apply_token_mask_ref  # grammar rows' bitmasks


@dataclass(frozen=True)
class Normed:
    """A projection's input with its RMSNorm already applied, by the all-reduce before it
    (model/shard.py, Shard.all_reduce_norm): x = rms_norm(summed) by norm_weight, and summed
    the residual stream. The projection after it runs without a norm of its own."""
    x: torch.Tensor
    summed: torch.Tensor
    norm_weight: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


@dataclass(frozen=True)
class Pushed:
    """A tensor-parallel rank's partial sum x that the projection computing it has already sent
    to its peers for the all-reduce in slot `slot` (kernels/all_reduce_triton.Push): that
    all-reduce only waits for the peers' words and sums (model/shard.py)."""
    x: torch.Tensor
    slot: int

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


@dataclass
class Prenormed:
    """The residual stream h ([rows, hidden], a projection's output plus the residual) with the
    next RMSNorm half done by that projection's epilogue (NORM_OUT): g = h * norm_weight,
    rounded, and each row's sum of squares in per-tile parts, ss [tiles, rows] in fp32. The
    projection after the norm takes g as its input and scales its dot products by 1 / rms(h)
    (ROW_SCALE), so no norm kernel runs between the two. The rounding differs from
    kernels/rmsnorm.py's (h * norm weight rounded once, 1 / rms applied to the fp32 sums):
    within the dtype's reduction tolerance, not bitwise."""

    h: torch.Tensor
    g: torch.Tensor
    ss: torch.Tensor
    norm_weight: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.h.shape


REFERENCE_OPS = Ops(
    name="reference",
    rms_norm=rmsnorm.rms_norm_ref,
    rope_write_kv=rope.rope_write_kv_ref,
    decode_attention=attention.paged_decode_attention_ref,
    prefill_attention=attention.paged_prefill_attention_ref,
    sample=sampling.sample_ref,
    argmax=sampling.argmax_ref,
    mask_stop_tokens=sampling.mask_stop_tokens_ref,
    logprobs=sampling.logprobs_ref,
    decode_metadata=advance.decode_metadata_ref,
    advance=advance.advance_ref,
    spec_advance=advance.spec_advance_ref,
    linear=linear.linear_ref,
    norm_linear=linear.norm_linear_ref,
    silu_mul_linear=linear.silu_mul_linear_ref,
    rope_decode_attention=attention.rope_decode_attention_ref,
)


PROJECTIONS = ("cublas", "auto")


def select_ops(device: torch.device, use_triton: bool | None = None,
               projections: str = "auto", batch_invariant: bool = False) -> Ops:
    """use_triton=None picks Triton on CUDA when it imports; False forces the references.
    projections: who runs the decode projections on CUDA: "cublas" or "auto" (Triton for
    one-row batches and, with their epilogues fused, for 33-64 rows; cuBLAS elsewhere).
    batch_invariant: kernels whose per-row results do not depend on the batch (Triton only; it
    overrides projections)."""
    if projections not in PROJECTIONS:
        raise ValueError(f"projections={projections!r} is not one of {PROJECTIONS}")
    if device.type != "cuda" or use_triton is False:
        return REFERENCE_OPS
    try:
        from .triton_ops import op_set
    except ImportError:
        if use_triton or batch_invariant:
            raise
        return REFERENCE_OPS
    return op_set(projections, batch_invariant, tuning_for(device))


def quantized_ops(base: Ops, device: torch.device, use_triton: bool | None = None) -> Ops:
    """base whose projections also take a QuantizedWeight (kernels/quant_ops.py): the Triton
    W8A16 / W4A16 kernels where base is a Triton set, the PyTorch references elsewhere."""
    from .quant_ops import quantized_reference_ops, quantized_triton_ops

    if base is REFERENCE_OPS or device.type != "cuda" or use_triton is False:
        return quantized_reference_ops(base)
    return quantized_triton_ops(base, tuning_for(device))
