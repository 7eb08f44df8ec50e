"""The W8A16 and W4A16 projections (kernels/linear_quant_triton.py) against their PyTorch
reference (kernels/linear_quant.py: dequantize, then F.linear in fp32 on the same inputs),
over shapes, group sizes, zero points, row counts, forced tiles and K splits."""
import pytest
import torch

from graphexec.kernels.linear_quant import linear_quant_ref
from graphexec.kernels.quant import quantize_fp8, quantize_int4
from kernel_helpers import DEV, INTERPRET, _check, _randn, big, kernel_test

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


def _check_w8a8(out, want):
    """W8A8 against fp32 sums: the fp8 tensor cores keep fewer bits of the running sum than
    fp32 (about 14), so the error grows with K: bounded against the output's scale, not
    element by element."""
    err = (out.float() - want).abs()
    assert err.max().item() <= 0.03 * want.abs().max().item()
    assert err.mean().item() <= 0.01 * want.abs().mean().item()


def _block_k(block_k, qw, k):
    """block_k cut to the group; int4 tiles are whole 64-column blocks (one for groups < 64)."""
    block_k = min(block_k, qw.group_size or k)
    return max(block_k, 64) if qw.format == "int4" else block_k


def _ref(x, qw, b=None):
    """fp32 sums over the dequantized weight, rounded once at the end."""
    return linear_quant_ref(x.float(), qw, None if b is None else b.float()).to(x.dtype)


def _want(x, qw, b=None):
    """_ref, or where linear_quant runs W8A8 (fp8 from fp8_scaled_mm_min_rows rows on CUDA)
    the same with the activations quantized per row first."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.linear_fp8_rows import linear_fp8_rows_ref

    return linear_fp8_rows_ref(x, qw, b) if lq.takes_w8a8(x, qw) else _ref(x, qw, b)


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
    if config is not None and config[0] == 1 and (m != 1 or fmt != "fp8"):
        pytest.skip("block_m 1 is fp8's one-row kernel")
    x = _randn((m, k + 8), dtype, 1)[:, 4:k + 4]  # rows strided wider than K
    qw = _quantize(_randn((n, k), torch.float32, 2, k ** -0.5), fmt)
    cfg = (lq.LinearConfig(config[0], config[1], _block_k(config[2], qw, k),
                           split_k=config[3]) if config else None)
    out = lq.linear_quant(x, qw, config=cfg)
    assert not torch.equal(out.float(), torch.zeros_like(out.float()))
    _check(out, _ref(x, qw) if cfg else _want(x, qw), dtype, "reduction")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("table", ["DEFAULT", "H200"])
@pytest.mark.parametrize("m", [2, 16, 33, 64])
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_each_gpu_table_matches_the_reference(table, m, fmt):
    """Every GPU's table runs on whatever GPU this is: its tiles, K splits and (fp8) the rows
    it sends to W8A8, against the reference."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels import tuning
    from graphexec.kernels.linear_fp8_rows import linear_fp8_rows_ref

    t = getattr(tuning, table).quant_linear
    n, k = big((6144, 4096), (96, 256))
    x = _randn((m, k), torch.bfloat16, 3)
    qw = _quantize(_randn((n, k), torch.float32, 4, k ** -0.5), fmt)
    out = lq.linear_quant(x, qw, t=t)
    if not lq.takes_w8a8(x, qw, t):
        _check(out, _ref(x, qw), torch.bfloat16, "reduction")
        return
    _check_w8a8(out, linear_fp8_rows_ref(x, qw, None).float())


# The int4 split the tile sweep (tools/lab/tune_quant_linear.py) measured fastest for
# llama-8b's qkv, o, gate_up and down on each GPU's table.
_INT4_SPLITS = {"DEFAULT": (4, 4, 1, 8), "H200": (8, 8, 1, 8)}


@pytest.mark.parametrize("table", sorted(_INT4_SPLITS))
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (40, 256)])
def test_int4_split_keeps_steps_and_bounds_columns(m, n, k, table):
    """int4 at 1-16 rows splits K in powers of two while each program keeps
    int4_min_split_steps K steps and columns x splits stay within int4_split_columns, as far
    as both allow; on llama-8b's projections that is the split the tile sweep measured
    fastest."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels import tuning

    t = getattr(tuning, table).quant_linear
    cfg, split = lq.pick_config(m, n, k, 128, int4=True, t=t)
    steps, columns = k // cfg.block_k, -(-n // cfg.block_n) * cfg.block_n
    assert split & (split - 1) == 0 and cfg.split_k == split
    if split > 1:
        assert steps // split >= t.int4_min_split_steps
        assert columns * split <= t.int4_split_columns
    assert (steps // (2 * split) < t.int4_min_split_steps
            or columns * 2 * split > t.int4_split_columns)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    if (n, k) in shapes:
        assert split == _INT4_SPLITS[table][shapes.index((n, k))]


def test_tuning_for_picks_the_table_by_gpu_name(monkeypatch):
    """A GPU whose name holds a BY_GPU key gets that table; any other GPU, and the CPU, get
    DEFAULT."""
    from graphexec.kernels import tuning

    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: names[d.index])
    assert tuning.tuning_for(torch.device("cuda", 0)) is tuning.H200
    assert tuning.tuning_for(torch.device("cuda", 1)) is tuning.DEFAULT
    assert tuning.tuning_for(torch.device("cpu")) is tuning.DEFAULT
    assert tuning.H200.quant_linear.config_for(1, 28672, False).block_k == 512
    assert tuning.DEFAULT.quant_linear.config_for(1, 28672, False).block_k == 1024


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
    out = lq.linear_quant(x, qw, b, config=lq.LinearConfig(16, 16, 64, split_k=split))
    _check(out, _ref(x, qw, b), torch.bfloat16, "reduction")


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("group,config", [(32, (16, 16, 32)), (64, (16, 16, 128)),
                                          (64, (1, 8, 64))])
def test_int4_tile_across_a_group_or_of_one_row_is_a_value_error(group, config):
    """int4 takes tensor-core tiles of whole 64-column blocks that stay inside one group."""
    from graphexec.kernels import linear_quant_triton as lq

    qw = quantize_int4(torch.randn(16, 128, device=DEV), group)
    x = torch.randn(1, 128, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match=f"group_size={group}"):
        lq.linear_quant(x, qw, config=lq.LinearConfig(*config))


@kernel_test
@pytest.mark.gpu
def test_many_rows_take_the_dense_gemm():
    from graphexec.kernels import linear_quant_triton as lq

    qw = _quantize(torch.randn(16, 128, device=DEV) * 128 ** -0.5, "int4")
    x = _randn((lq.DEFAULT.quant_linear.max_rows + 1, 128), torch.bfloat16, 6)
    _check(lq.linear_quant(x, qw), _ref(x, qw), torch.bfloat16, "reduction")


# (m, k, config): one row takes the fused prologue with the shipped tile, more rows with a
# forced one; a split K makes every program compute the row's norm itself
PROLOGUE_CASES = big([(1, 4096, None), (1, 14336, (1, 8, 128, 4)), (16, 4096, (16, 32, 64, 2))],
                     [(1, 256, None), (1, 256, (1, 8, 32, 2)), (5, 128, (16, 16, 32, 1))])


def _prologue_config(config, qw, k):
    """The forced tile (_block_k); int4 pads one row to a 16 x 16 tile."""
    from graphexec.kernels import linear_quant_triton as lq

    if config is None:
        return None
    bm, bn, bk, split = config
    if qw.format != "fp8":
        bm, bn = max(bm, 16), max(bn, 16)
    return lq.LinearConfig(bm, bn, _block_k(bk, qw, k), split_k=split)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,config", PROLOGUE_CASES)
@pytest.mark.parametrize("fmt", ["fp8", "int4_asym"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_quant(m, k, config, fmt, with_residual):
    """The RMSNorm of x + residual in the kernel's prologue, against the reference's norm and
    projection; the residual sum written once."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.linear_quant import norm_linear_quant_ref

    dtype, n = torch.bfloat16, 40
    x = _randn((m, k), dtype, 7, 3.0)
    res = _randn((m, k), dtype, 8, 3.0) if with_residual else None
    nw = (1.0 + 0.2 * _randn((k,), torch.float32, 9)).to(dtype)
    qw = _quantize(_randn((n, k), torch.float32, 10, k ** -0.5), fmt)
    cfg = _prologue_config(config, qw, k)
    out, summed = lq.norm_linear_quant(x, res, nw, 1e-5, qw, config=cfg)
    want, want_sum = norm_linear_quant_ref(x.float(), None if res is None else res.float(),
                                           nw.float(), 1e-5, qw)
    _check(out, want.to(dtype), dtype, "reduction")
    _check(summed, (x + res) if with_residual else x, dtype)


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,config", PROLOGUE_CASES)
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_silu_mul_linear_quant(m, k, config, fmt):
    """silu(gate) * up in the down projection's prologue, against the reference activation
    (rounded to bf16, as the kernel rounds it) and projection."""
    from graphexec.kernels import activation as act_ref
    from graphexec.kernels import linear_quant_triton as lq

    dtype, n = torch.bfloat16, 24
    gate_up = _randn((m, 2 * k), dtype, 11)
    qw = _quantize(_randn((n, k), torch.float32, 12, k ** -0.5), fmt)
    cfg = _prologue_config(config, qw, k)
    out = lq.silu_mul_linear_quant(gate_up, qw, config=cfg)
    _check(out, _ref(act_ref.silu_mul_ref(gate_up), qw), dtype, "reduction")


def _fp8_codes_close(q, want):
    """e4m3 codes equal but for a few one step apart: the kernel's sum of squares adds in
    another order than torch's mean, which can move a normed value by one bf16 ulp (and the
    interpreter truncates to bf16 where the GPU rounds: more of them there)."""
    a, b = q.view(torch.uint8).int(), want.view(torch.uint8).int()
    assert (a - b).abs().max().item() <= 1
    assert (a != b).float().mean().item() < (0.15 if INTERPRET else 0.01)


QUANT_ROWS_CASES = big([(1, 4096), (37, 14336), (64, 4096), (5, 28672)],
                       [(1, 256), (3, 96)])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,k", QUANT_ROWS_CASES)
@pytest.mark.parametrize("prologue", ["plain", "norm", "add_norm", "silu_mul"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_rows(m, k, prologue, dtype):
    """W8A8's input (kernels/quant_rows_triton.py): the prologue, then e4m3 per row with
    scale = max|row| / 448, against the PyTorch prologue and quantize_rows."""
    from graphexec.kernels import triton_ops  # noqa: F401 (the interpreter's e4m3 rounding)
    from graphexec.kernels.linear_fp8_rows import quantize_rows_ref
    from graphexec.kernels.quant_rows_triton import quantize_rows

    gated = prologue == "silu_mul"
    x = _randn((m, 2 * k if gated else k), dtype, 21, 3.0)
    x[0, :7] = 0.0  # a row's zeros stay zeros
    res = _randn((m, k), dtype, 22, 3.0) if prologue == "add_norm" else None
    nw = ((1.0 + 0.2 * _randn((k,), torch.float32, 23)).to(dtype)
          if prologue in ("norm", "add_norm") else None)
    if m > 2:  # an all-zero row: scale 1 (as the weights' zero channels)
        x[2] = 0.0
        if res is not None:
            res[2] = 0.0
    args = (x, res, nw, 1e-5, gated)
    q, scale, summed = quantize_rows(*args)
    want_q, want_scale, want_sum = quantize_rows_ref(*args)
    assert q.dtype == torch.float8_e4m3fn and q.shape == want_q.shape
    # within a bf16 ulp: the interpreter truncates to bf16 where the GPU rounds
    torch.testing.assert_close(scale, want_scale, rtol=2 ** -6, atol=0)
    _fp8_codes_close(q, want_q)
    _check(summed, want_sum, dtype)
    if m > 2:
        assert scale[2].item() == 1.0 and not q[2].float().any()
    # the largest element of each nonzero row lands on +-448
    assert torch.equal(q.float().abs().amax(dim=1)[scale[:, 0] != 1.0],
                       torch.full_like(scale[:, 0][scale[:, 0] != 1.0], 448.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm: CUDA")
@pytest.mark.parametrize("op", ["linear", "norm", "silu_mul"])
def test_w8a8_from_min_rows_matches_its_reference(op):
    """From fp8_scaled_mm_min_rows rows fp8 projections run W8A8: the fused quantizing kernel
    and torch._scaled_mm against the PyTorch prologue, quantize_rows and fp32 sums."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.linear_fp8_rows import quantize_rows_ref

    dtype, k, n = torch.bfloat16, 512, 96
    m = lq.DEFAULT.quant_linear.fp8_scaled_mm_min_rows + 20
    qw = quantize_fp8(_randn((n, k), torch.float32, 24, k ** -0.5))
    x = _randn((m, 2 * k if op == "silu_mul" else k), dtype, 25, 3.0)
    res, nw = _randn((m, k), dtype, 26, 3.0), (1.0 + 0.2 * _randn((k,), torch.float32, 27)).to(dtype)
    assert lq.takes_w8a8(x, qw, gated=op == "silu_mul")
    if op == "linear":
        out, (q, s, _) = lq.linear_quant(x, qw), quantize_rows_ref(x)
    elif op == "norm":
        (out, summed), (q, s, _) = (lq.norm_linear_quant(x, res, nw, 1e-5, qw),
                                    quantize_rows_ref(x, res, nw, 1e-5))
        assert torch.equal(summed, x + res)
    else:
        out, (q, s, _) = lq.silu_mul_linear_quant(x, qw), quantize_rows_ref(x, gated=True)
    want = (q.float() * s) @ (qw.data.float() * qw.scale[:, None]).T
    _check_w8a8(out, want)
    if op == "linear":  # W8A8 differs from W8A16 (the activations are rounded too)
        assert not torch.equal(out, lq.linear_quant(x, qw, config=lq.LinearConfig(64, 32, 128)))


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,split", big([(17, 6144, 4096, None), (64, 4096, 14336, None),
                                              (40, 1000, 896, 3)],
                                             [(5, 40, 256, None), (17, 72, 512, 2),
                                              (33, 64, 384, 3)]))
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_rows_match_their_reference(m, n, k, split, bias):
    """W8A8's Triton GEMM (kernels/linear_w8a8_triton.py) on rows already in e4m3: fp32 sums
    of the dequantized operands, over row counts, ragged columns and K splits."""
    from graphexec.kernels.linear_fp8_rows import _dequantized_mm, quantize_rows
    from graphexec.kernels.linear_w8a8_triton import matmul_rows

    dtype = torch.bfloat16
    x = _randn((m, k), dtype, 31, 3.0)
    qw = quantize_fp8(_randn((n, k), torch.float32, 32, k ** -0.5))
    b = _randn((n,), dtype, 33) if bias else None
    q, s = quantize_rows(x)
    out = matmul_rows(q, s, qw, b, dtype, split=split)
    want = _dequantized_mm(q, s, qw, b, torch.float32)
    assert out.dtype == dtype and out.shape == (m, n)
    # the fp8 tensor cores keep about 14 bits of the running sum: bounded by the output scale
    err = (out.float() - want).abs()
    assert err.max().item() <= 0.02 * want.abs().max().item()
    assert err.mean().item() <= 0.005 * want.abs().mean().item()


@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_rows_on_scaled_mm_match_their_reference(m, bias):
    """W8A8 through torch._scaled_mm (the fp8 tensor cores on the GPU; torch's CPU kernel
    here) against activations and weights dequantized by the formulas, fp32 sums."""
    from graphexec.kernels.linear_fp8_rows import linear_fp8_rows, linear_fp8_rows_ref

    dtype, dev = torch.bfloat16, "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(m, 256, generator=torch.Generator().manual_seed(1)) * 3).to(dev, dtype)
    qw = quantize_fp8(torch.randn(48, 256, device=dev) * 256 ** -0.5)
    b = torch.randn(48, device=dev).to(dtype) if bias else None
    _check(linear_fp8_rows(x, qw, b), linear_fp8_rows_ref(x, qw, b), dtype, "reduction")
    # the activation rounding is real: W8A8 differs from W8A16
    assert not torch.equal(linear_fp8_rows(x, qw), _ref(x, qw))


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_in_one_pass(fmt, dtype):
    """The dense copy above max_rows rows, against the reference's dequantize (ragged N and
    K against the tiles)."""
    from graphexec.kernels.dequant_triton import dequantize
    from graphexec.kernels.quant import dequantize as dequantize_ref

    qw = _quantize(_randn((37, 384), torch.float32, 13), fmt)
    # one rounding to dtype either way (the interpreter truncates to bf16 where the GPU
    # rounds: within _check's elementwise tolerance)
    _check(dequantize(qw, dtype), dequantize_ref(qw, dtype), dtype)


# (m, block_m, block_n, split): one row on fp8's CUDA cores (int4 pads it to 16), a few rows,
# two row blocks; split 3 makes each output tile's last program sum the partials
EPILOGUE_CASES = big([(1, 1, 8, 1), (1, 16, 64, 4), (9, 16, 32, 3), (40, 16, 64, 2),
                      (64, 64, 64, 1)],
                     [(1, 1, 8, 1), (1, 16, 16, 3), (5, 16, 16, 1), (20, 16, 32, 3)])


@kernel_test
@pytest.mark.gpu
@pytest.mark.parametrize("m,block_m,block_n,split", EPILOGUE_CASES)
@pytest.mark.parametrize("fmt", ["fp8", "int4_asym", "int4_g32"])
def test_residual_epilogue_begins_the_norm_the_next_projection_ends(m, block_m, block_n,
                                                                     split, fmt):
    """o / down with the residual add in the epilogue and the next RMSNorm begun (g = h * norm
    weight, per-tile sums of squares), then a projection taking that Prenormed (g in, 1 / rms
    on its sums), each against the dense reference; the ticket counters are left at zero for
    the next launch, which gives the same bits."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.linear_quant import linear_quant_add_ref, prenormed_linear_quant_ref
    from graphexec.kernels.tickets import ticket_counters

    if fmt != "fp8" and block_m == 1:
        block_m, block_n = 16, 16
    dtype, k, n, n2 = torch.bfloat16, 256, 128, 96
    x = _randn((m, k), dtype, 30)
    res = _randn((m, n), dtype, 31, 2.0)
    nw = (1.0 + 0.2 * _randn((n,), torch.float32, 32)).to(dtype)
    qw = _quantize(_randn((n, k), torch.float32, 33, k ** -0.5), fmt)
    qw2 = _quantize(_randn((n2, n), torch.float32, 34, n ** -0.5), fmt)

    def cfg(width):
        return lq.LinearConfig(block_m, block_n, _block_k(64, qw, width), split_k=split)

    h, summed, g, ss = lq._launch(x, qw, None, cfg(k), lq.DEFAULT.quant_linear, res_out=res,
                                  norm_out=nw)
    assert summed is x
    want = linear_quant_add_ref(x.float(), qw, res, nw)  # fp32 sums, as _ref
    _check(h, want.h.to(dtype), dtype, "reduction")
    # g and the sums of squares of the kernel's own h: the norm's share, exactly placed
    own = linear_quant_add_ref(torch.zeros_like(x), qw, h, nw)
    _check(g, own.g, dtype)
    assert ss.shape == (-(-n // block_n), m)
    torch.testing.assert_close(ss.sum(0), own.ss[0], atol=1e-3, rtol=1e-4)
    assert int(ticket_counters(x.device, 1).abs().sum()) == 0
    again = lq._launch(x, qw, None, cfg(k), lq.DEFAULT.quant_linear, res_out=res, norm_out=nw)
    assert torch.equal(again[0], h) and torch.equal(again[3], ss)

    p = lq.Prenormed(h, g, ss, nw)
    out = lq._launch(p.g, qw2, None, cfg(n), lq.DEFAULT.quant_linear, eps=1e-5,
                     row_scale=p.ss)[0]
    want = prenormed_linear_quant_ref(lq.Prenormed(h.float(), g, ss, nw.float()), 1e-5, qw2)
    _check(out, want.to(dtype), dtype, "reduction")


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                    reason="the interpreter runs no inline PTX: no hint is issued")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_l2_hint_changes_no_quantized_result(m):
    """The quantized projections warm L2 with the next weight (kernels/l2_prefetch.py) as the
    dense ones do: W8A16, W4A16 and W8A8 give the same bits with the hint as without."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.l2_prefetch import lines_per_program

    h, inter = 2048, 4096
    x, res = _randn((m, inter), torch.bfloat16, 81), _randn((m, h), torch.bfloat16, 82)
    nxt = quantize_int4(_randn((3 * h, h), torch.float32, 83))
    assert lines_per_program(nxt.data, 4 << 20, 64) > 0
    weights = [quantize_fp8(_randn((h, inter), torch.float32, 84, inter ** -0.5)),
               quantize_int4(_randn((h, inter), torch.float32, 85, inter ** -0.5))]
    runs = []
    for hint in (dict(), dict(prefetch=nxt, prefetch_bytes=4 << 20)):
        runs.append([f(w) for w in weights for f in (
            lambda w: lq.linear_quant(x, w, **hint),
            lambda w: lq.linear_quant_add(x, w, res, **hint))])
    for plain, hinted in zip(*runs):
        assert torch.equal(plain, hinted)
