"""The Triton implementations of `Ops` (CUDA): TRITON_OPS (projections on cuBLAS),
TRITON_SINGLE_ROW_OPS (Triton for one-row batches and 33-64 rows, cuBLAS elsewhere: the default) and BATCH_INVARIANT_OPS (per-row results
independent of the batch). Every function has the signature and semantics of the
reference it replaces (kernels/attention.py, linear.py, rmsnorm.py, rope.py, sampling.py) and
launches with grids taken from tensor shapes only, so a decode iteration built from them can be
captured in a CUDA graph. logprobs stays the reference (graph-safe torch ops)."""
from __future__ import annotations

import os


def _interpreter_compat() -> None:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) holds scalars as 1-element arrays and turns
    them into Python ints with int(array), which numpy >= 2.3 refuses for arrays of ndim 1;
    loops with tensor bounds (range(start, seq_len)) then fail. Take the element instead."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_graphexec_index_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._graphexec_index_patch = True


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpreter_compat()

from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402

from . import (activation_triton, advance_triton, attention_triton,  # noqa: E402
               linear_fused_triton, linear_invariant_triton, linear_triton, norm_rope_triton,
               sampling_triton, stop_tokens_triton)
from . import Normed, Ops  # noqa: E402
from .linear import linear_ref  # noqa: E402
from .sampling import logprobs_ref  # noqa: E402
from .weight_order import next_weight  # noqa: E402

TRITON_OPS = Ops(
    name="triton",
    rms_norm=norm_rope_triton.rms_norm,
    add_rms_norm=norm_rope_triton.add_rms_norm,
    apply_rope=norm_rope_triton.apply_rope,
    write_kv=attention_triton.write_kv,
    rope_write_kv=norm_rope_triton.rope_write_kv,
    silu_mul=activation_triton.silu_mul,
    decode_attention=attention_triton.decode_attention,
    prefill_attention=attention_triton.prefill_attention,
    sample=sampling_triton.sample,
    argmax=sampling_triton.argmax,
    mask_stop_tokens=stop_tokens_triton.mask_stop_tokens,
    logprobs=logprobs_ref,
    decode_metadata=advance_triton.decode_metadata,
    advance=advance_triton.advance,
    spec_advance=advance_triton.spec_advance,
    linear=linear_ref,  # cuBLAS
    norm_linear=linear_triton.norm_then_linear,
    silu_mul_linear=linear_triton.silu_mul_then_linear,
    rope_decode_attention=attention_triton.rope_decode_attention,
)

# The widest weight (the LM head) stays on Triton up to WIDE_MAX_ROWS rows, after the separate
# norm kernel: tools/tune_linear.py measured 347.5 against cuBLAS's 375.5 us at 5 rows for
# llama-8b's LM head and 179.3 against 190.4 at 16 rows for llama-1b's, and a batch-1
# speculative verify has K + 1 <= 9 rows. At 64 rows cuBLAS won inside the decode step.
# "Widest" by row count: the LM head of every preset; a gate_up of 65536+ rows (405B class)
# would take this path too, a speed question only (both paths compute the same projection).
WIDE_WEIGHT_ROWS = 65536
WIDE_MAX_ROWS = 16

# A Triton projection warms L2 with the first bytes of the weight of the projection after it
# (kernels/l2_prefetch.py), where the model linked them (kernels/weight_order.py): bytes by the
# kind of the projection that asks ("one_row": every projection of a one-row batch); 0 or
# absent for none. H100, llama-1b, tools/decode_variants.py --l2 (calls C-E, 2026-11-24):
# batch 64 1.3878-1.3951 ms a step with none, 1.3614-1.3685 with 2 MiB each, 1.3536 / 1.3421
# with 3 each; 2 / 3 / 4 / 3 (qkv / o / gate_up / down) 1.3546 / 1.3491; 4 MiB after qkv only
# (the attention between it and o) 1.3716, 8 there 1.3791. One row (the issue-3 forward,
# bench_kernels): 0 MiB 987.6-988.6 us, 2 MiB 985.9-987.1, 4 MiB 977.4-979.9, 8 MiB
# 1016-1019: past a few MiB the hints crowd out the kernels' own loads.
L2_PREFETCH_BYTES = {"qkv": 3 << 20, "o": 3 << 20, "gate_up": 3 << 20, "down": 3 << 20,
                     "one_row": 4 << 20}


def _warm_next(weight, kind: str) -> dict:
    """The prefetch arguments of a projection of `kind`."""
    return dict(prefetch=next_weight(weight), prefetch_bytes=L2_PREFETCH_BYTES.get(kind, 0))


def _warm_one_row(x, weight) -> dict:
    return _warm_next(weight, "one_row") if x.shape[0] == 1 else {}


def _auto_norm_linear(x, residual, norm_weight, eps, weight, bias=None, *, max_rows: int):
    if weight.shape[0] >= WIDE_WEIGHT_ROWS and max_rows < x.shape[0] <= WIDE_MAX_ROWS:
        normed, summed = linear_triton._norm(x, residual, norm_weight, eps)
        return linear_triton.linear(normed, weight, bias, max_rows=WIDE_MAX_ROWS), summed
    return linear_triton.norm_linear(x, residual, norm_weight, eps, weight, bias,
                                     max_rows=max_rows, **_warm_one_row(x, weight))


def _auto_linear(x, weight, bias=None, *, max_rows: int):
    return linear_triton.linear(x, weight, bias, max_rows=max_rows, **_warm_one_row(x, weight))


def _auto_silu_mul_linear(gate_up, weight, bias=None, *, max_rows: int):
    return linear_triton.silu_mul_linear(gate_up, weight, bias, max_rows=max_rows,
                                         **_warm_one_row(gate_up, weight))


def auto_ops(max_rows: int) -> Ops:
    """Triton projections up to max_rows rows, cuBLAS above (EngineConfig.projections="auto"),
    but for the LM head (WIDE_MAX_ROWS)."""
    return replace(
        TRITON_OPS, name="triton-auto", linear=partial(_auto_linear, max_rows=max_rows),
        norm_linear=partial(_auto_norm_linear, max_rows=max_rows),
        silu_mul_linear=partial(_auto_silu_mul_linear, max_rows=max_rows))


# The qkv projection of the fused path on Triton (after the norm kernel) instead of cuBLAS, for
# weights of up to this many elements, and the attention after it fetching its first KV tile
# before its PDL wait (which a cuBLAS kernel in front would not let start early): llama-1b's
# 3072 x 2048 at batch 64 1.4415 / 1.4386 ms a step against 1.4767 / 1.4811, at 48 1.4525
# against 1.4934; llama-8b's 6144 x 4096 6.759 against 6.6606 (H100, 2026-11-24, 659e267).
FUSED_QKV_TRITON_MAX_ELEMENTS = 8 << 20
# The same for a tensor-parallel rank's qkv, whose input the all-reduce has already normed:
# llama-8b at tensor_parallel_size 2 (3072 x 4096 a rank), batch 64, 3.337 / 3.339 / 3.339 ms
# a step against 3.368 on cuBLAS (two H200s, 2026-11-26, docs/benchmarks.md "Tensor
# parallelism", runs 9 and 10), though alone the kernel is slower (11.4 us against cuBLAS's
# 9.96, tools/tune_fused.py --tp 2): as a programmatic dependent it starts during the
# all-reduce before it.
RANK_QKV_TRITON_MAX_ELEMENTS = 16 << 20


def _plain(x):
    """The stream as a tensor, whether or not a projection began its next norm."""
    return x.h if isinstance(x, linear_fused_triton.Prenormed) else x


def _prenormed_by(x, norm_weight) -> bool:
    return isinstance(x, linear_fused_triton.Prenormed) and x.norm_weight is norm_weight


def fused_ops(base: Ops, min_rows: int, max_rows: int, rank: int | None = None) -> Ops:
    """base with, for batches of min_rows..max_rows rows, the residual add and the activation
    moved into the projections' epilogues (tensor-core Triton kernels): o and down add the
    residual stream to their output, so the norms after them only normalise; gate_up computes
    silu(gate) * up; a small qkv projection (FUSED_QKV_TRITON_MAX_ELEMENTS) runs on Triton
    too. A layer is then eight launches instead of nine, and the activation makes no extra
    round trip through memory. The norms stay their own kernels: folded into the prologue at
    64 rows, where every program re-reads the rows, the qkv projection ran 2.5x slower
    (tools/tune_fused.py). Other row counts, and the LM head, run as in base. A wrong guess of
    last_qkv_triton (below) costs speed only: the prefetch is safe at any row count.

    rank: the set for one tensor-parallel rank, where o and down return partial sums that the
    model all-reduces, the residual passed on (the all-reduce adds it, or else the next norm),
    and norm_linear and mlp may receive a Normed (its norm done by that all-reduce); the next
    norm is not begun (a partial sum's norm is no part of the whole's). A rank's qkv runs on
    Triton up to RANK_QKV_TRITON_MAX_ELEMENTS instead. Given push=, a rank's o and down on
    Triton send their partial sums to the peers from their epilogue (a Pushed comes back);
    given gather=, a rank's LM head on Triton returns the whole logits, the peers' columns
    landed by their LM heads (kernels/gather_triton.py)."""
    def fused(x):
        return min_rows <= x.shape[0] <= max_rows

    # Whether the last qkv projection ran on Triton: a layer's attention follows its qkv
    # projection (the only norm_linear here besides the LM head), and prefetches after Triton.
    last_qkv_triton = [False]

    def norm_linear(x, residual, norm_weight, eps, weight, bias=None, gather=None):
        if gather is not None and fused(x) and bias is None and not isinstance(x, Normed):
            # a rank's LM head, gathering the logits in its epilogue where the kernel can
            normed, summed = linear_triton._norm(_plain(x), residual, norm_weight, eps)
            logits = linear_fused_triton.linear_gathered(normed, weight, gather,
                                                         max_rows=max_rows)
            if logits is not None:
                return logits, summed
            return base.linear(normed, weight), summed
        if isinstance(x, Normed):  # a rank's qkv input, normed by the all-reduce before it
            triton_qkv = fused(x) and weight.numel() <= RANK_QKV_TRITON_MAX_ELEMENTS
            last_qkv_triton[0] = triton_qkv
            if not triton_qkv:
                return base.linear(x.x, weight, bias), x.summed
            config = linear_fused_triton.pick_fused_config(x.shape[0], *weight.shape, "qkv")
            return linear_triton.linear(x.x, weight, bias, config, max_rows=max_rows,
                                        **_warm_next(weight, "qkv")), x.summed
        if weight.shape[0] >= WIDE_WEIGHT_ROWS:  # the LM head
            if not fused(x):
                return base.norm_linear(_plain(x), residual, norm_weight, eps, weight, bias)
            normed, summed = linear_triton._norm(_plain(x), residual, norm_weight, eps)
            config = linear_fused_triton.pick_fused_config(x.shape[0], *weight.shape, "lm_head")
            return linear_triton.linear(normed, weight, bias, config, max_rows=max_rows), summed
        triton_qkv = fused(x) and weight.numel() <= FUSED_QKV_TRITON_MAX_ELEMENTS
        last_qkv_triton[0] = triton_qkv
        if triton_qkv and _prenormed_by(x, norm_weight):
            config = linear_fused_triton.pick_fused_config(x.shape[0], *weight.shape, "qkv")
            return linear_fused_triton.prenormed_linear(x, eps, weight, bias, config,
                                                        max_rows=max_rows,
                                                        **_warm_next(weight, "qkv")), x.h
        x = _plain(x)
        if not triton_qkv:
            return base.norm_linear(x, residual, norm_weight, eps, weight, bias)
        normed, summed = linear_triton._norm(x, residual, norm_weight, eps)
        config = linear_fused_triton.pick_fused_config(x.shape[0], *weight.shape, "qkv")
        return linear_triton.linear(normed, weight, bias, config, max_rows=max_rows,
                                    **_warm_next(weight, "qkv")), summed

    def rope_decode_attention(q, *args, **kwargs):
        if fused(q) and last_qkv_triton[0]:
            return base.rope_decode_attention(q, *args, prefetch=True, **kwargs)
        return base.rope_decode_attention(q, *args, **kwargs)

    prenorm = rank is None

    def add(x, weight, residual, next_norm, kind, push=None):
        """x's projection plus the residual; a rank's partial sum alone (sent to the peers
        from the epilogue where push says and the kernel can)."""
        if rank is not None:
            return linear_fused_triton.linear_partial(x, weight, max_rows=max_rows, push=push,
                                                      **_warm_next(weight, kind))
        return linear_fused_triton.linear_add(x, weight, residual, max_rows=max_rows,
                                              next_norm=next_norm, **_warm_next(weight, kind))

    def out_linear(x, weight, residual, next_norm=None, push=None):
        if not fused(x) or residual is None:
            return base.linear(x, weight), residual
        if rank is not None:  # the residual passes on to the all-reduce or the next norm
            return add(x, weight, None, None, "o", push), residual
        return add(x, weight, residual, next_norm if prenorm else None, "o"), None

    def mlp(x, residual, norm_weight, eps, gate_up, down, next_norm=None, push=None):
        normed_in = isinstance(x, Normed)  # a rank's input, normed by the all-reduce before it
        if not fused(x):
            if normed_in:
                return base.silu_mul_linear(base.linear(x.x, gate_up), down), x.summed
            h, summed = base.norm_linear(_plain(x), residual, norm_weight, eps, gate_up)
            return base.silu_mul_linear(h, down), summed
        if _prenormed_by(x, norm_weight):
            act = linear_fused_triton.prenormed_linear(x, eps, gate_up, silu_out=True,
                                                       max_rows=max_rows,
                                                       **_warm_next(gate_up, "gate_up"))
            summed = x.h
        else:
            normed, summed = ((x.x, x.summed) if normed_in else
                              linear_triton._norm(_plain(x), residual, norm_weight, eps))
            act = linear_fused_triton.linear_silu(normed, gate_up, max_rows=max_rows,
                                                  **_warm_next(gate_up, "gate_up"))
        if rank is not None:
            return add(act, down, None, None, "down", push), summed
        # the next layer's qkv takes a Prenormed only on Triton (this layer's tells)
        return add(act, down, summed, next_norm if prenorm and last_qkv_triton[0] else None,
                   "down"), None

    name = f"{base.name}-fused{min_rows}-{max_rows}" + ("" if rank is None else f"-rank{rank}")
    return replace(base, name=name, norm_linear=norm_linear, out_linear=out_linear, mlp=mlp,
                   rope_decode_attention=(None if base.rope_decode_attention is None
                                          else rope_decode_attention),
                   for_rank=None if rank is not None else (
                       lambda r: fused_ops(base, min_rows, max_rows, rank=r)),
                   rank_set=rank is not None)


# Triton for one-row batches only, where it measured faster than cuBLAS on every projection
# (tools/tune_linear.py): above, cuBLAS was as fast or faster, and Triton up to 8 rows made
# llama-1b decode steps at batch 4 and 8 about 4% slower (decode_variants auto-rows8).
AUTO_MAX_ROWS = 1
# The epilogue-fused projections from 33 to 64 rows (the 48 and 64 buckets): llama-1b batch 64,
# H100, 1.4784 / 1.4892 ms a decode step against 1.566 / 1.5748 without; at 16 and 32 rows
# they were slower (1.4814 against 1.3869 ms, 1.5493 against 1.4547; decode_variants fused).
FUSED_MIN_ROWS, FUSED_MAX_ROWS = 33, 64
TRITON_SINGLE_ROW_OPS = fused_ops(auto_ops(AUTO_MAX_ROWS), FUSED_MIN_ROWS, FUSED_MAX_ROWS)


# Per-row results that do not depend on the batch (EngineConfig.batch_invariant): what lets a
# bf16 draft that equals the target be accepted every time.
BATCH_INVARIANT_OPS = replace(TRITON_OPS, name="triton-batch-invariant",
                              linear=linear_invariant_triton.linear_invariant,
                              norm_linear=linear_invariant_triton.norm_linear_invariant,
                              silu_mul_linear=linear_invariant_triton.silu_mul_linear_invariant,
                              decode_attention=attention_triton.decode_attention_invariant,
                              prefill_attention=attention_triton.prefill_attention_invariant,
                              # the separate rope_write_kv: prefill writes KV with it, and a
                              # recompute must rebuild those bits exactly
                              rope_decode_attention=None, all_reduce_norm=False)
