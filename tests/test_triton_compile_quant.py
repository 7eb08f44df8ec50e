"""The quantized projections and the fp8 KV cache's kernels compile for an H100 (sm_90) on a
machine without a GPU, through tests/test_triton_compile.py's stand-in driver: they stream
their weights with vector or async copies, convert to e4m3 with saturation, and under
programmatic dependent launch touch nothing an earlier kernel wrote before their wait."""
from __future__ import annotations

import re

import pytest
import torch

from test_triton_compile import _before_wait, _bf16, compiled, pytestmark  # noqa: F401

triton = pytest.importorskip("triton")


def test_quantized_projections_compile_and_stream_weights(compiled, monkeypatch):
    """W8A16 and W4A16 (kernels/linear_quant_triton.py) at decode row counts: the stored
    weight is read with vector loads, never one byte or word an element. int4 unpacks two
    codes a register (lop3, then an fma in bf16x2 or f16x2), and its tiles of 64+ columns
    feed Hopper's wgmma the unpacked weight from registers."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels.quant import quantize_fp8, quantize_int4

    # CPU tensors stand in for CUDA ones: the device test passed, the kernels as on the GPU
    monkeypatch.setattr(lq, "supported", lambda x, w, max_rows, *a: x.shape[0] <= max_rows)
    h, inter = 2048, 8192
    weights = [quantize_fp8(torch.randn(h, inter)), quantize_int4(torch.randn(h, inter)),
               quantize_int4(torch.randn(h, inter), symmetric=False)]
    for m in (1, 16, 64):
        for w in weights:
            lq.linear_quant(_bf16(m, inter), w)
    for w in weights:  # one row: the norm or the activation in the prologue
        lq.norm_linear_quant(_bf16(1, inter), _bf16(1, inter), _bf16(inter), 1e-5, w)
        lq.silu_mul_linear_quant(_bf16(1, 2 * inter), w)
        # fp16 activations, a bias (Qwen2's qkv), a forced K split
        lq.linear_quant(torch.randn(4, inter).half(), w, torch.randn(h).half())
        lq.linear_quant(_bf16(1, inter), w, config=lq.LinearConfig(
            1 if w.format == "fp8" else 16, 16, 128, 8))
    for m in (1, 16, 64):  # o / down adding the stream and beginning the norm, and after it
        for w in weights:
            p = lq.linear_quant_add(_bf16(m, inter), w, _bf16(m, h), _bf16(h))
            lq.prenormed_linear_quant(p, 1e-5, quantize_int4(torch.randn(inter, h)))
    names = [name for name, _ in compiled]
    # the split-K sums are the last program's of each tile: no kernel of their own
    assert {"_w8a16_kernel", "_w4a16_kernel"} <= set(names), names
    assert "_split_sum_kernel" not in names
    consts_of = [{k.src.fn.arg_names[i[0]]: v for i, v in k.src.constants.items()}
                 for name, k in compiled if name == "_w4a16_kernel"]
    assert any(c["RES_OUT"] and c["NORM_OUT"] for c in consts_of)
    assert any(c["ROW_SCALE"] for c in consts_of)
    for name, kernel in compiled:
        if name in ("_w8a16_kernel", "_w4a16_kernel"):
            ptx = kernel.asm["ptx"]
            # one row: vector loads; more: the pipelined loop's 8- and 16-byte async copies
            fast = len(re.findall(r"cp\.async\.\w+\.shared\.global|ld\.global(?:\.\w+)*\.v[248]",
                                  ptx))
            consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
            assert fast > 0, (name, sorted(consts.items()))
            if "atom.global" in ptx:  # a split K's ticket publishes the partials it follows
                assert re.search(r"atom\.global\.(gpu\.)?acq_rel|atom\.acq_rel\.gpu", ptx), name
            if name == "_w8a16_kernel":
                assert not consts["UPCAST"]
                continue
            assert consts["ASM"] and "lop3.b32" in ptx
            assert re.search(r"fma\.rn\.(bf16x2|f16x2)", ptx)
            if consts["BLOCK_N"] >= 64:  # wgmma's A operand in registers: {%r..}, not a
                # shared-memory descriptor
                assert re.search(r"wgmma\.mma_async\S* \{[^}]*\}, \{%r", ptx), consts


def test_w8a8_compiles_to_fp8_tensor_cores(compiled, monkeypatch):
    """W8A8's GEMM at decode batches (kernels/linear_w8a8_triton.py) runs on the tensor
    cores, split or not, with a bias, e4m3 by e4m3 on wgmma at every row count: a tile of
    fewer than 64 rows would run Ampere's mma, which has no fp8, on converted operands."""
    from graphexec.kernels import linear_w8a8_triton as w8
    from graphexec.kernels.linear_fp8_rows import quantize_rows
    from graphexec.kernels.quant import quantize_fp8

    monkeypatch.setattr(w8, "_runs_here", lambda q: True)
    for m, n, k in ((17, 6144, 4096), (64, 28672, 4096)):
        q, s = quantize_rows(_bf16(m, k))
        w8.matmul_rows(q, s, quantize_fp8(torch.randn(n, k)), _bf16(n), torch.bfloat16)
    ptxs = [kernel.asm["ptx"] for name, kernel in compiled if name == "_w8a8_kernel"]
    assert len(ptxs) == 2
    for m, ptx in zip((17, 64), ptxs):
        assert re.search(r"wgmma\.\S*e4m3\.e4m3", ptx), f"no fp8 wgmma at {m} rows"
        assert "mma.sync" not in ptx, m


def test_kv_kernels_compile_for_an_fp8_cache(compiled):
    """kv_cache_dtype="fp8": the KV writes (alone, with rope, inside the fused decode
    attention) convert to e4m3 with saturation, and decode and prefill attention read it."""
    from graphexec.kernels import rope, write_kv_triton
    from graphexec.kernels.attention_decode_triton import decode_attention_splits
    from graphexec.kernels.triton_ops import TRITON_OPS as ops

    t, hq, hk, d, bs, nb = 6, 32, 8, 128, 16, 64
    q, k, v = _bf16(t, hq, d), _bf16(t, hk, d), _bf16(t, hk, d)
    pos, slots = torch.arange(t), torch.arange(t)
    cos, sin = rope.rope_cos_sin(4096, d, 500000.0)
    kc, vc = (torch.zeros(nb, bs, hk, d, dtype=torch.float8_e4m3fn) for _ in range(2))
    ops.rope_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    write_kv_triton.write_kv(kc, vc, k, v, slots)
    tables = torch.arange(t * 8, dtype=torch.int32).view(t, 8)
    lens = torch.full((t,), 100, dtype=torch.int32)
    decode_attention_splits(q, kc, vc, tables, lens, d ** -0.5, 1,
                            rope=(k, v, pos, cos, sin, slots))
    decode_attention_splits(q, kc, vc, tables, lens, d ** -0.5, 4)
    cu = torch.tensor([0, 2, t], dtype=torch.int32)
    ops.prefill_attention(q, kc, vc, cu, torch.tensor([50, 4], dtype=torch.int32),
                          tables[:2], d ** -0.5)
    names = [name for name, _ in compiled]
    assert {"_rope_write_kv_kernel", "_write_kv_kernel", "_decode_split_kernel",
            "_prefill_kernel"} <= set(names), names
    for name, kernel in compiled:
        ptx = kernel.asm["ptx"]
        if name in ("_rope_write_kv_kernel", "_write_kv_kernel"):
            assert "cvt.rn.satfinite.e4m3x2" in ptx, name
        if name in ("_decode_split_kernel", "_prefill_kernel"):
            # the tiles become fp16 a pair an instruction, and the dots run on fp16, not bf16
            assert "cvt.rn.f16x2.e4m3x2" in ptx, name
            assert re.search(r"\.f32\.f16\.f16\.f32|\.f16\.f16", ptx), name
            assert not re.search(r"\.f32\.bf16\.bf16\.f32", ptx), name


def test_quantized_projections_with_programmatic_dependent_launch(compiled, monkeypatch):
    """As the dense projections: W8A16 and W4A16 launched as programmatic dependents fetch
    their first weight tile (and its scales) before griddepcontrol.wait, store nothing before
    it, and signal their own dependents. Tensor-core tiles launch so only with
    QuantLinearTuning.pdl_tensor_cores; fp8's one-row kernel always does."""
    from dataclasses import replace

    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels import pdl
    from graphexec.kernels.quant import quantize_fp8, quantize_int4

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    monkeypatch.setattr(lq, "supported", lambda x, w, max_rows, *a: x.shape[0] <= max_rows)
    t = replace(lq.DEFAULT.quant_linear, pdl_tensor_cores=True)
    h = 2048
    for m in (1, 16):
        for w in (quantize_fp8(torch.randn(h, h)), quantize_int4(torch.randn(h, h), 128, False)):
            lq.linear_quant(_bf16(m, h), w, t=t)
            if m == 1:  # the norm's pass over x and the residual sum come after the wait
                lq.norm_linear_quant(_bf16(1, h), _bf16(1, h), _bf16(h), 1e-5, w, t=t)
    kernels = [k for name, k in compiled if name in ("_w8a16_kernel", "_w4a16_kernel")]
    assert len(kernels) == 6
    for kernel in kernels:
        assert kernel.metadata.launch_pdl
        before = _before_wait(kernel.asm["ptx"])
        assert re.search(r"ld\.global|cp\.async", before), "the first weight tile"
    compiled.clear()
    lq.linear_quant(_bf16(16, h), quantize_int4(torch.randn(h, h), 128, False))
    lq.linear_quant(_bf16(1, h), quantize_fp8(torch.randn(h, h)))
    assert [k.metadata.launch_pdl for _, k in compiled] == [False, True]


def test_quantized_projections_warm_the_next_weight(compiled, monkeypatch):
    """Given the next projection's weight, W8A16, W4A16 and W8A8 ask L2 for its first bytes
    (prefetch.global.L2::evict_last) once their own loads are issued; without, they ask for
    nothing."""
    from graphexec.kernels import linear_quant_triton as lq
    from graphexec.kernels import linear_w8a8_triton as w8
    from graphexec.kernels.linear_fp8_rows import quantize_rows
    from graphexec.kernels.quant import quantize_fp8, quantize_int4

    monkeypatch.setattr(lq, "supported", lambda x, w, max_rows, *a: x.shape[0] <= max_rows)
    monkeypatch.setattr(w8, "_runs_here", lambda q: True)
    h = 2048
    nxt = quantize_int4(torch.randn(3 * h, h))
    fp8 = quantize_fp8(torch.randn(h, h))
    q, s = quantize_rows(_bf16(64, h))
    for hint in (dict(prefetch=nxt, prefetch_bytes=1 << 20), dict()):
        for m, w in ((1, fp8), (16, fp8), (1, quantize_int4(torch.randn(h, h)))):
            lq.linear_quant(_bf16(m, h), w, **hint)
        w8.matmul_rows(q, s, fp8, None, torch.bfloat16, **hint)
    hinted = []
    for name, kernel in compiled:
        if name in ("_w8a16_kernel", "_w4a16_kernel", "_w8a8_kernel"):
            consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
            asks = "prefetch.global.L2::evict_last" in kernel.asm["ptx"]
            assert asks == (consts["PF_LINES"] > 0), (name, consts)
            hinted.append(asks)
    assert hinted == [True] * 4 + [False] * 4


def test_dequantize_kernel_compiles(compiled):
    from graphexec.kernels.dequant_triton import dequantize
    from graphexec.kernels.quant import quantize_fp8, quantize_int4

    for w in (quantize_fp8(torch.randn(256, 512)), quantize_int4(torch.randn(256, 512)),
              quantize_int4(torch.randn(256, 512), symmetric=False)):
        dequantize(w, torch.bfloat16)
    assert [name for name, _ in compiled] == ["_dequant_kernel"] * 3


def test_row_quantization_compiles_and_waits_first(compiled, monkeypatch):
    """W8A8's input kernel (kernels/quant_rows_triton.py) for each prologue: the rows convert
    to e4m3 with saturation, and as a programmatic dependent it reads and stores nothing
    before its wait."""
    from graphexec.kernels import pdl
    from graphexec.kernels.quant_rows_triton import quantize_rows

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    h, inter = 4096, 14336
    quantize_rows(_bf16(64, h))
    quantize_rows(_bf16(64, h), _bf16(64, h), _bf16(h), 1e-5)
    quantize_rows(_bf16(64, 2 * inter), gated=True)
    kernels = [k for name, k in compiled if name == "_quant_rows_kernel"]
    assert len(kernels) == 3
    for kernel in kernels:
        ptx = kernel.asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2" in ptx
        assert kernel.metadata.launch_pdl
        assert not re.search(r"ld\.global|st\.global", _before_wait(ptx))
