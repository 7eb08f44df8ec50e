"""The Triton implementations of `Ops` (CUDA): TRITON_OPS (projections on cuBLAS), and through
op_set the sets of kernels/op_sets.py (projections="auto", the default, and batch_invariant).
Every function has the signature and semantics of the
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
    _interpreter_fp8_rounding(interpreter)


def _interpreter_fp8_rounding(interpreter) -> None:
    """The interpreter's float -> e4m3 conversion drops the carry when rounding up overflows
    the mantissa (127.9 becomes 64, not 128), so an fp8 KV cache written under it would be
    wrong where the GPU's conversion is right; convert through torch (round to nearest even,
    saturating) instead."""
    import numpy as np
    import torch
    import triton.language as tl

    original = interpreter._convert_float
    floats = {tl.float32: np.float32, tl.float16: np.float16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in (*floats, tl.bfloat16):
            return original(data, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.bfloat16:  # held as uint16: the top half of an fp32
            bits = np.frombuffer(data.tobytes(), dtype=np.uint16).astype(np.uint32) << 16
            x = bits.view(np.float32)
        else:
            x = np.frombuffer(data.tobytes(), dtype=floats[input_dtype]).astype(np.float32)
        out = torch.from_numpy(x.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return out.reshape(data.shape)

    interpreter._convert_float = convert


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _interpreter_compat()

from . import (advance_triton, attention_decode_triton, attention_prefill_triton,  # noqa: E402
               linear_triton, norm_rope_triton, penalties_triton, sampling_triton,
               stop_tokens_triton, token_mask_triton)
from dataclasses import replace  # noqa: E402
from functools import partial  # noqa: E402

from . import Ops  # noqa: E402
from .linear import linear_ref  # noqa: E402
from .op_sets import auto_ops, invariant_ops  # noqa: E402
from .sampling import logprobs_ref  # noqa: E402
from .tuning import Tuning  # noqa: E402

TRITON_OPS = Ops(
    name="triton",
    rms_norm=norm_rope_triton.rms_norm,
    rope_write_kv=norm_rope_triton.rope_write_kv,
    decode_attention=attention_decode_triton.decode_attention,
    prefill_attention=attention_prefill_triton.prefill_attention,
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
    rope_decode_attention=attention_decode_triton.rope_decode_attention,
    apply_logit_bias=penalties_triton.apply_logit_bias,
    apply_penalties=penalties_triton.apply_penalties,
    apply_min_p=penalties_triton.apply_min_p,
    count_tokens=penalties_triton.count_tokens,
    apply_token_mask=token_mask_triton.apply_token_mask,
)


def tuned(ops: Ops, tuning: Tuning) -> Ops:
    """ops with the attention, sampling, norm and rope kernels launched from `tuning`'s
    tables."""
    a, s, e = tuning.attention, tuning.sampling, tuning.elementwise
    return replace(ops, rms_norm=partial(ops.rms_norm, tuning=e),
                   rope_write_kv=partial(ops.rope_write_kv, tuning=e),
                   decode_attention=partial(ops.decode_attention, tuning=a),
                   prefill_attention=partial(ops.prefill_attention, tuning=a),
                   rope_decode_attention=partial(ops.rope_decode_attention, tuning=a),
                   sample=partial(ops.sample, tuning=s), argmax=partial(ops.argmax, tuning=s))


def op_set(projections: str, batch_invariant: bool, tuning: Tuning) -> Ops:
    """The Triton op set for EngineConfig's projections ("auto" or "cublas") and
    batch_invariant, with the launch configs and thresholds of `tuning`."""
    base = tuned(TRITON_OPS, tuning)
    if batch_invariant:
        return invariant_ops(base, tuning)
    if projections == "cublas":
        return base
    return auto_ops(base, tuning.linear)
