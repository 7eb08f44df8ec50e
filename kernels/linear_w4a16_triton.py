"""W4A16: the int4 projection kernel, its weight in plane order (kernels/quant.py) unpacked in
registers straight into the tensor cores' operand. Launched by kernels/linear_quant_triton.py
(which picks the tile and the K split); reference: kernels/linear_quant.py.

int4 is bound by unpacking, not by its bytes: a tile's codes must reach the tensor cores'
operand registers as bf16 / fp16 with few instructions each, and at decode sizes the few
resident programs wait on those instructions' latency more than they fill the issue slots. Its
weights come in plane order, so nibble j of the tile's int16 halves is a plane of 16 K columns a
block: an elementwise function of the loaded halves, which Triton computes in the operand's
register layout after one shared-memory pass of the packed bytes (a function that moved values
between threads would send every unpacked bf16 value through shared memory). The weight is the
left operand (out.T = w @ x.T): Hopper's wgmma takes its left operand from registers, and the
rows, padded to 16, are its narrow side. Two codes share a 32-bit register: one shift, one lop3
that puts both nibbles in the mantissas of 128.0 (bf16) or 1024.0 (fp16), whose ulp is 1, and
one fma that takes 136 + zero away, all exact (_plane). The group's scale multiplies each tile's
fp32 partial sums.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import linear_tiles_triton as tiles
from . import pdl
from . import quant_tiles_triton as qt


@triton.jit
def _halves(w_rows, k0, n_ok, BLOCK_K: tl.constexpr):
    """The int4 tile [BLOCK_N, BLOCK_K / 4] as stored, read as int16: four codes a half."""
    hk = tl.max_contiguous(tl.multiple_of(k0 // 4 + tl.arange(0, BLOCK_K // 4), BLOCK_K // 4),
                           BLOCK_K // 4)
    return tl.load(w_rows + hk[None, :], mask=n_ok[:, None], other=0)


@triton.jit
def _plane(halves, j: tl.constexpr, offset, dtype: tl.constexpr, ASM: tl.constexpr):
    """Nibble j of every half minus offset (offset = magic + 8 + zero): the codes q - zero in
    dtype. ASM: two codes a 32-bit register, put in the mantissas of the magic number (bf16
    128, fp16 1024: ulp 1) by one lop3, then one fma subtracts the offset; exact. Else (the
    interpreter, which runs no PTX) the same in fp32."""
    if ASM:
        if j == 0:
            shift: tl.constexpr = "mov.b32 t, $1; "
        elif j == 1:
            shift: tl.constexpr = "shr.u32 t, $1, 4; "
        elif j == 2:
            shift: tl.constexpr = "shr.u32 t, $1, 8; "
        else:
            shift: tl.constexpr = "shr.u32 t, $1, 12; "
        if dtype == tl.bfloat16:
            code: tl.constexpr = ("lop3.b32 t, t, 0x000F000F, 0x43004300, 0xea; "
                                  "mov.b32 one, 0x3F803F80; fma.rn.bf16x2 $0, t, one, $2; }")
        else:
            code: tl.constexpr = ("lop3.b32 t, t, 0x000F000F, 0x64006400, 0xea; "
                                  "mov.b32 one, 0x3C003C00; fma.rn.f16x2 $0, t, one, $2; }")
        w = tl.inline_asm_elementwise("{ .reg .b32 t, one; " + shift + code, "=r,r,r",
                                      [halves, -offset], dtype=offset.dtype, is_pure=True,
                                      pack=2)
    else:
        magic = 128.0 if dtype == tl.bfloat16 else 1024.0
        w = ((halves.to(tl.int32) >> (4 * j)) & 0xF).to(tl.float32) + magic - offset
    return w


@triton.jit
def _group_terms(s_rows, z_rows, ssg, szg, g, n_ok, dtype: tl.constexpr,
                 HAS_ZERO: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """(_plane's offset [BLOCK_N, 1]: magic + 8 + zero, in dtype for ASM else fp32; the
    group's fp32 scale [BLOCK_N]) for group g."""
    offset = tl.full([BLOCK_N], 136.0 if dtype == tl.bfloat16 else 1032.0, tl.float32)
    if HAS_ZERO:
        offset += tl.load(z_rows + g * szg, mask=n_ok, other=0).to(tl.float32)
    if ASM:
        offset = offset.to(dtype)
    return offset[:, None], tl.load(s_rows + g * ssg, mask=n_ok, other=0.0)


@triton.jit
def _plane_dot(p, halves, j: tl.constexpr, offset, x_cols, ks, m_ok, dtype: tl.constexpr,
               ASM: tl.constexpr):
    """p + plane j of the tile [BLOCK_N, BLOCK_K / 4] times x's matching columns, transposed
    [BLOCK_K / 4, BLOCK_M] (ks: the columns of plane 0)."""
    x = tl.load(x_cols + (ks + 16 * j)[:, None], mask=m_ok[None, :], other=0.0)
    if not ASM:
        x = x.to(tl.float32)  # the interpreter gets bf16 dots wrong
    return tl.dot(_plane(halves, j, offset, dtype, ASM), x, p)


@triton.jit
def _w4_step(acc, halves, x_cols, s_rows, z_rows, ssg, szg, k0, m_ok, n_ok,
             dtype: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
             ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus the tile at K columns k0.. (its halves loaded) times x: the
    planes' sums scaled once a tile, or once a plane for groups of 16 or 32 (a tile is then
    one 64-column block)."""
    e = tl.arange(0, BLOCK_K // 4)
    ks = k0 + (e // 16) * 64 + e % 16  # the K column of each half's nibble 0
    zeros = tl.zeros(acc.shape, dtype=tl.float32)
    if GROUP >= 64:
        offset, scale = _group_terms(s_rows, z_rows, ssg, szg, k0 // GROUP, n_ok, dtype,
                                     HAS_ZERO, ASM, BLOCK_N)
        p = zeros
        for j in tl.static_range(4):
            p = _plane_dot(p, halves, j, offset, x_cols, ks, m_ok, dtype, ASM)
        acc += p * scale[:, None]
    else:
        for j in tl.static_range(4):
            offset, scale = _group_terms(s_rows, z_rows, ssg, szg, (k0 + 16 * j) // GROUP,
                                         n_ok, dtype, HAS_ZERO, ASM, BLOCK_N)
            acc += _plane_dot(zeros, halves, j, offset, x_cols, ks, m_ok, dtype,
                              ASM) * scale[:, None]
    return acc


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, r_ptr, nw_ptr,
                  g_ptr, ss_out_ptr, ss_in_ptr, pf_ptr, M, N, K, KH, k_per_split, sx, ssg, szg,
                  sr, n_ss, pf_total, eps, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RES_OUT: tl.constexpr, NORM_OUT: tl.constexpr,
                  ROW_SCALE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_SS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ASM: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
                  PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    """int4 weight [N, K / 4] int16 in plane order (kernels/quant.py; stored as q + 8), fp32
    scale and int8 zero point [N, K / GROUP] group-major (group strides ssg, szg): out = sum
    over groups of (x @ (q - zero).T) * scale, computed as its transpose [BLOCK_N, BLOCK_M]
    (the module docstring). BLOCK_K is whole 64-column blocks inside one group, or one block
    for groups of 16 or 32; KH = K / 4, the halves a row, passed so that Triton sees its
    alignment (vector loads). The epilogue: quant_tiles_triton.finish_tile (ROW_SCALE: x is
    a Prenormed's g, its rows' 1 / rms from ss_in [n_ss, M]); PF_LINES: the L2 hint
    (kernels/l2_prefetch.py) after the loop."""
    rm, rn, m_ok, n_ok, k_lo, k_hi, pid_n = qt.tile_ids(M, N, K, k_per_split, BLOCK_M,
                                                        BLOCK_N)
    dtype = out_ptr.dtype.element_ty
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * sx
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * KH
    s_rows = s_ptr + rn
    z_rows = z_ptr + rn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    terms = (x_cols, s_rows, z_rows, ssg, szg)
    k_start = k_lo
    if PDL:
        pdl.gdc_launch_dependents()
        first = _halves(w_rows, k_lo, n_ok, BLOCK_K)
        pdl.gdc_wait()
        acc = _w4_step(acc, first, *terms, k_lo, m_ok, n_ok, dtype, GROUP, HAS_ZERO, ASM,
                       BLOCK_N, BLOCK_K)
        k_start = k_lo + BLOCK_K
    if ROW_SCALE:
        ss_parts = tiles.load_row_ss(ss_in_ptr, n_ss, rm, m_ok, M, BLOCK_SS)
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        acc = _w4_step(acc, _halves(w_rows, k0, n_ok, BLOCK_K), *terms, k0, m_ok, n_ok, dtype,
                       GROUP, HAS_ZERO, ASM, BLOCK_N, BLOCK_K)
    tiles.warm_next(pf_ptr, pf_total, PF_LINES, PF_LINE)
    if ROW_SCALE:
        acc = acc * tiles.row_rstd(ss_parts, K, eps)[None, :]
    qt.finish_tile(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, b_ptr, r_ptr, nw_ptr, g_ptr,
                   ss_out_ptr, rm, rn, m_ok, n_ok, pid_n, M, N, sr, HAS_BIAS, RES_OUT, NORM_OUT,
                   SPLIT)
