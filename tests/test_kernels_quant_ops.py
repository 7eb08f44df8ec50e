"""The quantized op set over the Triton sets (kernels/quant_ops.py): a layer's projections with
quantized weights, through norm_linear, out_linear, mlp and a tensor-parallel rank's set, at
one row and in the epilogue-fused row range, against the reference set on the dequantized
weights; a dense weight in the same set (the LM head) still runs the base set's kernels."""
import pytest
import torch

from graphexec.kernels import REFERENCE_OPS, Prenormed
from graphexec.kernels.quant import dequantize, quantize_fp8, quantize_int4
from kernel_helpers import _check, _randn, kernel_test

HID, INTER = 128, 256


def _sets(w8a8: bool = True):
    """The shipped sets; w8a8=False keeps fp8 on W8A16 at every row count (the dequantized
    reference is then its oracle)."""
    from dataclasses import replace

    from graphexec.kernels.quant_ops import quantized_triton_ops
    from graphexec.kernels.triton_ops import op_set
    from graphexec.kernels.tuning import DEFAULT

    t = DEFAULT if w8a8 else replace(DEFAULT, quant_linear=replace(
        DEFAULT.quant_linear, fp8_scaled_mm_min_rows=0))
    return quantized_triton_ops(op_set("auto", False, t), t)


def _layer(fmt, dtype):
    q = quantize_fp8 if fmt == "fp8" else (lambda w: quantize_int4(w, 64, fmt == "int4"))
    shapes = dict(qkv=(3 * HID, HID), o=(HID, HID), gate_up=(2 * INTER, HID), down=(HID, INTER))
    out = {}
    for i, (name, s) in enumerate(shapes.items()):
        qw = q(_randn(s, torch.float32, 10 + i, s[1] ** -0.5))
        out[name] = (qw, dequantize(qw, dtype))
    return out


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int4", "int4_asym"])
@pytest.mark.parametrize("rows", [1, 40])
def test_layer_projections_match_the_reference(fmt, rows):
    dtype = torch.bfloat16
    ops, ref = _sets(w8a8=False), REFERENCE_OPS
    assert ops.name.endswith("-quantized")
    w = _layer(fmt, dtype)
    x = _randn((rows, HID), dtype, 1)
    res = _randn((rows, HID), dtype, 2)
    nw = (1 + 0.1 * _randn((HID,), torch.float32, 3)).to(dtype)
    got, got_sum = ops.norm_linear(x, res, nw, 1e-5, w["qkv"][0])
    want, want_sum = ref.norm_linear(x, res, nw, 1e-5, w["qkv"][1])
    _check(got, want, dtype, "reduction")
    _check(got_sum, want_sum, dtype)
    # o adds the residual in its epilogue and begins the next norm, which qkv finishes
    h, passed = ops.out_linear(x, w["o"][0], res, nw)
    assert isinstance(h, Prenormed) and passed is None
    stream = ref.linear(x, w["o"][1]) + res
    _check(h.h, stream, dtype, "reduction")
    got, got_sum = ops.norm_linear(h, passed, nw, 1e-5, w["qkv"][0])
    want, _ = ref.norm_linear(h.h, None, nw, 1e-5, w["qkv"][1])
    _check(got, want, dtype, "reduction")
    assert got_sum is h.h
    # the MLP from a Prenormed: gate_up finishes the norm, down adds the stream
    h2, passed = ops.mlp(h, None, nw, 1e-5, w["gate_up"][0], w["down"][0], nw)
    assert isinstance(h2, Prenormed) and passed is None
    gu, _ = ref.norm_linear(h.h, None, nw, 1e-5, w["gate_up"][1])
    # three bf16 rounding points in a chain (gate_up, the activation, down), each free to
    # round the other way: a few ulps of the largest values
    torch.testing.assert_close(h2.h.float(),
                               (ref.silu_mul_linear(gu, w["down"][1]) + h.h).float(),
                               atol=8e-2, rtol=4e-2)
    # and from the plain stream: the norm kernel first
    h3, passed = ops.mlp(x, res, nw, 1e-5, w["gate_up"][0], w["down"][0], None)
    gu, want_sum = ref.norm_linear(x, res, nw, 1e-5, w["gate_up"][1])
    assert passed is None and not isinstance(h3, Prenormed)
    torch.testing.assert_close(h3.float(),
                               (ref.silu_mul_linear(gu, w["down"][1]) + want_sum).float(),
                               atol=8e-2, rtol=4e-2)
    # a rank's set: o's partial sum alone, the residual passed on to the all-reduce
    rank = ops.for_rank(0)
    h, passed = rank.out_linear(x, w["o"][0], res, None)
    assert passed is res
    _check(h, ref.linear(x, w["o"][1]), dtype, "reduction")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="W8A8 runs on CUDA only")
def test_layer_projections_on_w8a8_stay_near_the_reference():
    """fp8 from fp8_scaled_mm_min_rows rows: the activations are rounded to e4m3 too, so a
    layer's outputs move by a few percent of their scale, no more (a wrong scale or row would
    move them by their whole size). The kernels' exact oracle is in test_kernels_quant_linear."""
    from graphexec.kernels.tuning import DEFAULT

    dtype, rows = torch.bfloat16, DEFAULT.quant_linear.fp8_scaled_mm_min_rows + 23
    ops, ref = _sets(), REFERENCE_OPS
    w = _layer("fp8", dtype)
    x, res = _randn((rows, HID), dtype, 1), _randn((rows, HID), dtype, 2)
    nw = (1 + 0.1 * _randn((HID,), torch.float32, 3)).to(dtype)

    def near(got, want):
        err = (got.float() - want.float()).abs()
        assert err.max().item() <= 0.1 * want.float().abs().max().item()
        assert err.mean().item() <= 0.05 * want.float().abs().mean().item()

    got, got_sum = ops.norm_linear(x, res, nw, 1e-5, w["qkv"][0])
    want, want_sum = ref.norm_linear(x, res, nw, 1e-5, w["qkv"][1])
    near(got, want)
    _check(got_sum, want_sum, dtype)
    h, stream = ops.out_linear(x, w["o"][0], res, nw)  # W8A8: the add left to the next norm
    assert stream is res
    near(h, ref.linear(x, w["o"][1]))
    h, summed = ops.mlp(x, res, nw, 1e-5, w["gate_up"][0], w["down"][0], nw)
    gu, _ = ref.norm_linear(x, res, nw, 1e-5, w["gate_up"][1])
    near(h, ref.silu_mul_linear(gu, w["down"][1]))
    _check(summed, want_sum, dtype)


@kernel_test
@pytest.mark.gpu
def test_dense_weights_keep_the_base_set():
    dtype = torch.bfloat16
    ops = _sets()
    x = _randn((1, HID), dtype, 4)
    dense = _randn((96, HID), dtype, 5, HID ** -0.5)
    _check(ops.linear(x, dense), REFERENCE_OPS.linear(x, dense), dtype, "reduction")


@kernel_test
@pytest.mark.gpu
def test_a_dense_layer_before_a_quantized_one():
    """A checkpoint may leave a layer dense: in the 33-64-row range its down projection adds
    the residual and begins the next norm (a Prenormed), which the next, quantized, qkv takes
    as the stream it is."""
    dtype, rows = torch.bfloat16, 40
    ops, ref = _sets(), REFERENCE_OPS
    x = _randn((rows, HID), dtype, 20)
    res = _randn((rows, HID), dtype, 21)
    nw = (1 + 0.1 * _randn((HID,), torch.float32, 22)).to(dtype)
    gate_up = _randn((2 * INTER, HID), dtype, 23, HID ** -0.5)
    down = _randn((HID, INTER), dtype, 24, INTER ** -0.5)
    qkv = _layer("int4", dtype)["qkv"]
    # a dense qkv on Triton first, as in a model whose layer before was dense: the set then
    # lets down begin the next norm
    ops.norm_linear(x, res, nw, 1e-5, _randn((3 * HID, HID), dtype, 25, HID ** -0.5))
    h, passed = ops.mlp(x, res, nw, 1e-5, gate_up, down, nw)
    assert hasattr(h, "h") and passed is None, "no Prenormed: the case is not exercised"
    got, got_sum = ops.norm_linear(h, passed, nw, 1e-5, qkv[0])
    gu, summed = ref.norm_linear(x, res, nw, 1e-5, gate_up)
    stream = ref.silu_mul_linear(gu, down) + summed
    want, want_sum = ref.norm_linear(stream, None, nw, 1e-5, qkv[1])
    torch.testing.assert_close(got_sum.float(), want_sum.float(), atol=8e-2, rtol=4e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=8e-2, rtol=4e-2)


def test_each_quantized_projection_warms_the_one_after_it():
    """The Triton set passes each quantized projection the weight the model launches next
    (Ops.link_weights) and QuantLinearTuning.l2_prefetch_bytes; the reference set no hint."""
    from graphexec.kernels.quant_ops import QuantizedOps
    from graphexec.kernels.weight_order import WeightOrder

    shapes = dict(qkv=(3 * HID, HID), o=(HID, HID), gate_up=(2 * INTER, HID), down=(HID, INTER))
    layer = {name: quantize_int4(torch.randn(s), 64) for name, s in shapes.items()}
    lm_head = torch.zeros(8, HID)
    calls = []

    def record(name):
        return lambda *args, **hint: calls.append((name, hint.get("prefetch"),
                                                   hint.get("prefetch_bytes"))) or (None, None)

    def no_hint(*args, **hint):
        assert not hint
        return None, None

    for order, nbytes in ((WeightOrder(), 1 << 20), (None, 0)):
        fn = record if order is not None else (lambda name: no_hint)
        ops = QuantizedOps(REFERENCE_OPS, fn("linear"), fn("norm_linear"), fn("silu_mul"),
                           order=order, prefetch_bytes=nbytes).ops()
        ops.link_weights([layer["qkv"], layer["o"], layer["gate_up"], layer["down"], lm_head])
        x = torch.zeros(1, HID)
        ops.norm_linear(x, None, torch.ones(HID), 1e-5, layer["qkv"])
        ops.linear(x, layer["o"])
        ops.norm_linear(x, None, torch.ones(HID), 1e-5, layer["gate_up"])
        ops.silu_mul_linear(torch.zeros(1, 2 * INTER), layer["down"])
    assert calls == [("norm_linear", layer["o"], 1 << 20), ("linear", layer["gate_up"], 1 << 20),
                     ("norm_linear", layer["down"], 1 << 20), ("silu_mul", lm_head, 1 << 20)]
