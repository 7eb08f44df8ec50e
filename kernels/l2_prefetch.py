"""Warming L2 with the next projection's weights (sm_80+).

At a kernel boundary of the decode step the memory pipe drains: the programs of the kernel
before finish their last tiles, the next kernel's programs start and wait for their first ones.
A projection that knows which weight comes next (kernels/weight_order.py) asks L2
for the first bytes of it once its own weight loop is done, so HBM keeps streaming across the
boundary, and across the latency-bound attention between qkv and o. The hint carries no data
dependency: it only changes where the next kernel's loads are served from, never what they
read (weights are not written during decode), so results are unchanged."""
from __future__ import annotations

import triton
import triton.language as tl

LINE_BYTES = 128


@triton.jit
def prefetch_l2(ptr, total, program, LINES: tl.constexpr, LINE: tl.constexpr):
    """This program's share of the hint: LINES lines of LINE elements from ptr, starting at
    line program * LINES, clamped to the tensor's total elements (repeats are harmless)."""
    offs = (program * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE
    offs = tl.minimum(offs, total - 1)
    # evict_last: keep the lines until the next kernel reads them; no register is loaded
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                              "=r,l", [ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


def lines_per_program(next_weight, max_bytes: int, programs: int) -> int:
    """LINES for prefetch_l2: the first min(next_weight's bytes, max_bytes) over the programs,
    as a power of two (0: no hint)."""
    if next_weight is None or max_bytes <= 0:
        return 0
    lines = triton.cdiv(min(next_weight.numel() * next_weight.element_size(), max_bytes),
                        LINE_BYTES)
    return triton.next_power_of_2(triton.cdiv(lines, programs))


def hint(next_weight, max_bytes: int, programs: int, stand_in, off: bool = False
         ) -> tuple[object, int, dict]:
    """A launch's hint operands: (pointer, total elements, the PF_LINES / PF_LINE constexprs)
    for `programs` programs warming the first max_bytes of next_weight; stand_in is passed
    where there is no hint (next_weight None, max_bytes 0, or off: Triton's interpreter)."""
    lines = 0 if off else lines_per_program(next_weight, max_bytes, programs)
    if lines == 0:
        return stand_in, 0, dict(PF_LINES=0, PF_LINE=1)
    return (next_weight, next_weight.numel(),
            dict(PF_LINES=lines, PF_LINE=LINE_BYTES // next_weight.element_size()))
