"""The W8A16 and W4A16 projections (kernels/linear_quant_triton.py) against their PyTorch
reference (kernels/linear_quant.py: dequantize, then F.linear in fp32 on the same inputs),
over shapes, group sizes, zero points, row counts, forced tiles and K splits."""
import pytest
import torch

from graphexec.kernels.linear_quant import linear_quant_ref
from graphexec.kernels.quant import quantize_fp8, quantize_int4
from kernel_helpers import DEV, _check, _randn, big, kernel_test

SHAPES = big([(1, 4096, 4096), (1, 4096, 14336), (7, 6144, 4096), (16, 28672, 4096),
              (64, 4096, 14336), (33, 1000, 896)],
             [(1, 40, 256), (3, 37, 128), (17, 24, 256)])
# (block_m, block_n, block_k, split): None = the tuning table's pick
CONFIGS = big([None, (1, 8, 128, 4), (16, 32, 64, 1), (64, 64, 128, 2)],
              [None, (1, 8, 32, 2), (16, 16, 32, 1), (64, 16, 64, 2)])
FORMATS = ["fp8", "int4", "int4_asym", "int4_g32"]


def _quantize(w, fmt):
    if fmt == "fp8":
        return quantize_fp8(w)
    return quantize_int4(w, 32 if fmt == "int4_g32" else 128, symmetric=fmt != "int4_asym")


def _ref(x, qw, b=None):
    """fp32 sums over the dequantized weight, rounded once at the end."""
    return linear_quant_ref(x.float(), qw, None if b is None else b.float()).to(x.dtype)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_quant(m, n, k, config, fmt, dtype):
    from graphexec.kernels import linear_quant_triton as lq

    if dtype == torch.float16 and config is not None:
        pytest.skip("fp16 takes the bf16 code but for the element type: the shipped configs")
    if config is not None and config[0] == 1 and m != 1:
        pytest.skip("block_m 1 is the one-row kernel")
    x = _randn((m, k + 8), dtype, 1)[:, 4:k + 4]  # rows strided wider than K
    qw = _quantize(_randn((n, k), torch.float32, 2, k ** -0.5), fmt)
    group = qw.group_size or k
    cfg = (lq.LinearConfig(config[0], config[1], min(config[2], group), split_k=config[3])
           if config else None)
    out = lq.linear_quant(x, qw, config=cfg)
    assert not torch.equal(out.float(), torch.zeros_like(out.float()))
    _check(out, _ref(x, qw), dtype, "reduction")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [1, 2])
def test_linear_quant_bias(fmt, split):
    from graphexec.kernels import linear_quant_triton as lq

    m, n, k = 3, 24, 256
    x = _randn((m, k), torch.bfloat16, 3)
    qw = _quantize(_randn((n, k), torch.float32, 4, k ** -0.5), fmt)
    b = _randn((n,), torch.bfloat16, 5)
    out = lq.linear_quant(x, qw, b, config=lq.LinearConfig(16, 16, 32, split_k=split))
    _check(out, _ref(x, qw, b), torch.bfloat16, "reduction")


@kernel_test
@pytest.mark.gpu
def test_block_k_across_a_group_is_a_value_error():
    from graphexec.kernels import linear_quant_triton as lq

    qw = quantize_int4(torch.randn(16, 128), 32)
    x = torch.randn(1, 128, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="group_size=32"):
        lq.linear_quant(x, qw, config=lq.LinearConfig(1, 8, 64))


@kernel_test
@pytest.mark.gpu
def test_many_rows_take_the_dense_gemm():
    from graphexec.kernels import linear_quant_triton as lq

    qw = _quantize(torch.randn(16, 128) * 128 ** -0.5, "int4")
    x = _randn((lq.DEFAULT.quant_linear.max_rows + 1, 128), torch.bfloat16, 6)
    _check(lq.linear_quant(x, qw), _ref(x, qw), torch.bfloat16, "reduction")
