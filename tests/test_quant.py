"""kernels/quant.py: the formats' layout against compressed-tensors' packing, the quantizers'
error bounds, and slicing by channels and groups (tensor parallelism)."""
import pytest
import torch

from graphexec.kernels.quant import (QuantizedWeight, cat_rows, dequantize, pack_int4, quantize_fp8,
                           quantize_int4, unpack_int4)


def test_int4_packing_is_compressed_tensors_layout():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (5, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_int4(q), helpers.pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(helpers.pack_to_int32(q, 4)), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_channel_scale_and_error(dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(16, 256, generator=g) * torch.linspace(0.01, 3, 16)[:, None]).to(dtype)
    qw = quantize_fp8(w)
    assert qw.shape == w.shape and qw.dtype == dtype and qw.numel() == w.numel()
    torch.testing.assert_close(qw.scale, w.float().abs().amax(1) / 448)
    err = (dequantize(qw, torch.float32) - w.float()).abs()
    # e4m3 keeps 3 mantissa bits: at most half a step, 1/16 of the value, per element; near
    # zero the subnormals' fixed step of 2^-9 (times the scale) bounds it instead
    assert (err <= w.float().abs() / 16 + qw.scale[:, None] * 2 ** -10 + 1e-7).all()
    assert qw.nbytes == 16 * 256 + 16 * 4


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_groups_and_error(symmetric, group):
    torch.manual_seed(group)
    w = torch.randn(8, 512) + (0 if symmetric else 0.7)
    qw = quantize_int4(w, group, symmetric)
    assert qw.data.shape == (8, 64) and qw.scale.shape == (8, 512 // group)
    assert (qw.zero is None) == symmetric
    err = (dequantize(qw) - w).abs().reshape(8, -1, group)
    assert (err <= qw.scale[..., None] / 2 + 1e-5).all()  # round to nearest: half a step


def test_asymmetric_is_tighter_on_shifted_weights():
    torch.manual_seed(1)
    w = torch.rand(8, 256) + 1.0  # all positive: symmetric wastes the negative codes
    sym = (dequantize(quantize_int4(w)) - w).abs().mean()
    asym = (dequantize(quantize_int4(w, symmetric=False)) - w).abs().mean()
    assert asym < sym / 1.5


def test_rows_and_cols_slice_with_their_scales():
    w = torch.randn(12, 512)
    for qw in (quantize_fp8(w), quantize_int4(w, 128, False)):
        whole = dequantize(qw)
        torch.testing.assert_close(dequantize(qw.rows(4, 8)), whole[4:8], rtol=0, atol=0)
        torch.testing.assert_close(dequantize(qw.cols(256, 512)), whole[:, 256:],
                                   rtol=0, atol=0)
        stacked = cat_rows([qw.rows(0, 4), qw.rows(4, 12)])
        torch.testing.assert_close(dequantize(stacked), whole, rtol=0, atol=0)


def test_a_slice_through_a_group_is_a_value_error():
    with pytest.raises(ValueError, match="split a group"):
        quantize_int4(torch.randn(4, 256)).cols(0, 192)


def test_bad_layouts_are_value_errors():
    with pytest.raises(ValueError, match="format"):
        QuantizedWeight("int8", torch.zeros(2, 2), torch.ones(2))
    with pytest.raises(ValueError, match="fp8 weight"):
        QuantizedWeight("fp8", torch.zeros(2, 2), torch.ones(2))
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4(torch.randn(4, 200), 128)


def test_scaled_multiplies_output_channels_through_their_scales():
    w = torch.randn(6, 256)
    f = torch.tensor([1.0, 2.0, 0.5, 4.0, 0.25, 3.0])
    for qw in (quantize_fp8(w), quantize_int4(w, 64, False)):
        torch.testing.assert_close(dequantize(qw.scaled(f)), dequantize(qw) * f[:, None])


def test_int4_plane_order():
    """Half e of each 64-column block, read as int16, holds at bits 4j the code of column
    16j + e of the block (stored as q + 8); the kernels and the dense copy rely on it."""
    from graphexec.kernels.quant import pack_planes, unpack_planes

    q = torch.randint(-8, 8, (3, 192), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    halves = pack_planes(q).view(torch.int16).to(torch.int32) & 0xFFFF
    for block in range(3):
        for e in range(16):
            for j in range(4):
                got = (halves[:, block * 16 + e] >> (4 * j)) & 0xF
                assert torch.equal(got - 8, q[:, block * 64 + 16 * j + e].to(torch.int32))
    assert torch.equal(unpack_planes(pack_planes(q)), q)


def test_int4_needs_whole_plane_blocks():
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4(torch.randn(4, 192), 48)
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(torch.randn(4, 96), 32)
    with pytest.raises(ValueError, match="64-column block"):
        quantize_int4(torch.randn(4, 256), 32).cols(0, 96)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_a_prenormed_stream_stands_for_its_norm(fmt):
    """The norm the quantized kernels split between o / down and the projection after them
    (kernels/linear_quant.py, the references): projecting g = h * norm weight and scaling each
    row's sums by 1 / rms(h), from the carried sums of squares, is the projection of
    rms_norm(h); and h is the projection plus the residual."""
    from graphexec.kernels.linear_quant import (linear_quant_add_ref, linear_quant_ref,
                                                prenormed_linear_quant_ref)

    g = torch.Generator().manual_seed(5)
    k, n, n2, eps = 128, 64, 96, 1e-5

    def quant(w):
        return quantize_fp8(w) if fmt == "fp8" else quantize_int4(w, 64)

    x = torch.randn(5, k, generator=g)
    res = 3 * torch.randn(5, n, generator=g)
    nw = 1 + 0.2 * torch.randn(n, generator=g)
    qw, qw2 = quant(torch.randn(n, k, generator=g)), quant(torch.randn(n2, n, generator=g))
    p = linear_quant_add_ref(x, qw, res, nw)
    torch.testing.assert_close(p.h, linear_quant_ref(x, qw) + res)
    assert p.ss.shape == (1, 5) and p.norm_weight is nw
    rstd = torch.rsqrt(p.ss.sum(0) / n + eps)
    torch.testing.assert_close(linear_quant_ref(p.g, qw2) * rstd[:, None],
                               prenormed_linear_quant_ref(p, eps, qw2), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_quant_add_ref(x, qw, res), p.h)
