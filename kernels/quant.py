"""QuantizedWeight: a projection weight kept in a compressed form, and the round-to-nearest
quantizers that make one from a dense weight at load.

Two formats, the ones people deploy on H100s and the ones compressed-tensors checkpoints hold:

- "fp8": float8_e4m3fn [N, K] with one fp32 scale per output channel (w ~ q * scale[n]); a
  per-tensor scale from a checkpoint is broadcast to every channel, so kernels see one layout.
- "int4": [N, K / 8] int32, eight 4-bit values a word, each stored as q + 8 so a nibble is
  unsigned, in plane order (pack_planes): groups of `group_size` along K with one fp32 scale
  each (w ~ (q - zero) * scale), and for the asymmetric kind a signed int8 zero point per
  group. K is a whole number of 64-column blocks, and a group is 16 or 32 columns or whole
  blocks.

Plane order: read as int16, the 16 halves of a 64-column block hold at nibble j (bits 4j) the
codes of columns 16j..16j+15 of the block, one column a half. So nibble j of a tile's halves is
a [N, 16-column] plane that the W4A16 kernel unpacks two codes to a 32-bit register with no
data movement (kernels/linear_quant_triton.py). compressed-tensors' pack-quantized checkpoints
keep the eight values of a word in K order (pack_int4); they are repacked at load.

A QuantizedWeight stands where a weight tensor stands (LayerWeights, the projection ops): it
answers shape, numel(), dim(), device, dtype (the activation dtype it dequantizes to) and
nbytes. Op sets dispatch on its type (kernels/quant_ops.py)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FORMATS = ("fp8", "int4")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_MIN, INT4_MAX = -8, 7
PACK = 8  # int4 values per int32 word
PLANE_BLOCK = 64  # K columns a block of int4's plane order spans (four planes of 16)
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    format: str  # "fp8" or "int4"
    data: torch.Tensor  # fp8: [N, K] float8_e4m3fn; int4: [N, K // 8] int32
    scale: torch.Tensor  # fp32; fp8: [N]; int4: [N, K // group_size], stored group-major
    zero: torch.Tensor | None = None  # int4 asymmetric: [N, K // group_size] int8, as scale
    group_size: int = 0  # int4 only
    out_dtype: torch.dtype = torch.bfloat16  # the activation dtype it dequantizes to

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is not one of {FORMATS}")
        n = self.data.shape[0]
        if self.format == "fp8":
            if self.data.dtype != torch.float8_e4m3fn or self.scale.shape != (n,):
                raise ValueError(f"fp8 weight: data {self.data.dtype} {tuple(self.data.shape)}"
                                 f", scale {tuple(self.scale.shape)}: want float8_e4m3fn "
                                 f"[N, K] and [N]")
            return
        k = self.data.shape[1] * PACK
        g = self.group_size
        if self.data.dtype != torch.int32 or k % PLANE_BLOCK or not plane_group(g) or k % g:
            raise ValueError(f"int4 weight: data {self.data.dtype} {tuple(self.data.shape)}, "
                             f"group_size={g}: want int32 [N, K / 8] with K a multiple of "
                             f"{PLANE_BLOCK}, and a group_size of 16, 32 or a multiple of "
                             f"{PLANE_BLOCK} dividing K")
        if self.scale.shape != (n, k // g) or (
                self.zero is not None and self.zero.shape != (n, k // g)):
            raise ValueError(f"int4 weight: scale {tuple(self.scale.shape)}, zero "
                             f"{None if self.zero is None else tuple(self.zero.shape)}: "
                             f"want [{n}, {k // g}]")
        # Stored group-major (strides (1, N)): a kernel tile's output channels then read their
        # group's scales from one run of memory, not one sector a channel. On an H100 it took
        # llama-8b's four int4 projections at 64 rows from 214 to 177 us.
        object.__setattr__(self, "scale", _group_major(self.scale))
        if self.zero is not None:
            object.__setattr__(self, "zero", _group_major(self.zero))

    @property
    def shape(self) -> torch.Size:
        n, cols = self.data.shape
        return torch.Size((n, cols * PACK if self.format == "int4" else cols))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        n, k = self.shape
        return n * k

    @property
    def nbytes(self) -> int:
        """The bytes a projection reads: data, scales and zero points."""
        return sum(t.numel() * t.element_size()
                   for t in (self.data, self.scale, self.zero) if t is not None)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output channels start..stop, with their scales (and zero points)."""
        return replace(self, data=self.data[start:stop].contiguous(),
                       scale=self.scale[start:stop].contiguous(),
                       zero=None if self.zero is None else self.zero[start:stop].contiguous())

    def scaled(self, factors: torch.Tensor) -> QuantizedWeight:
        """The weight with output channel n multiplied by factors[n]: only the scales change."""
        f = factors.to(self.scale.device, torch.float32)
        return replace(self, scale=self.scale * (f if self.format == "fp8" else f[:, None]))

    def cols(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns start..stop: fp8 scales are per row and stay; int4 keeps whole groups,
        so a slice that would cut one is a ValueError."""
        if self.format == "fp8":
            return replace(self, data=self.data[:, start:stop].contiguous())
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"int4 weight of group_size={g}: a slice of input columns "
                             f"{start}..{stop} would split a group between two ranks")
        if start % PLANE_BLOCK or stop % PLANE_BLOCK:
            raise ValueError(f"int4 weight: a slice of input columns {start}..{stop} would "
                             f"split a {PLANE_BLOCK}-column block of its plane order")
        return replace(self, data=self.data[:, start // PACK:stop // PACK].contiguous(),
                       scale=self.scale[:, start // g:stop // g].contiguous(),
                       zero=None if self.zero is None
                       else self.zero[:, start // g:stop // g].contiguous())


def plane_group(group_size) -> bool:
    """Whether int4's plane order takes groups of this many input columns: 16, 32 or whole
    64-column blocks."""
    return isinstance(group_size, int) and group_size > 0 and (
        group_size in (16, 32) or group_size % PLANE_BLOCK == 0)


def stored(weight):
    """The tensor a projection streams for this weight: a QuantizedWeight's stored data (its
    scales are a small share), a dense weight itself; None stays None."""
    return weight.data if isinstance(weight, QuantizedWeight) else weight


def _group_major(t: torch.Tensor) -> torch.Tensor:
    """t [N, G] with its N values of each group adjacent in memory."""
    return t if t.stride() == (1, t.shape[0]) else t.t().contiguous().t()


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one format stacked by output channel (q, k, v into qkv; gate, up)."""
    first = parts[0]
    if any(p.format != first.format or p.group_size != first.group_size
           or (p.zero is None) != (first.zero is None) for p in parts):
        raise ValueError("stacked projections must share one quantization format and group "
                         f"size, got {[(p.format, p.group_size) for p in parts]}")
    return replace(first, data=torch.cat([p.data for p in parts]),
                   scale=torch.cat([p.scale for p in parts]),
                   zero=None if first.zero is None else torch.cat([p.zero for p in parts]))


def quantize_fp8(w: torch.Tensor, out_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Per output channel: scale = max|w| / 448 over the channel, q = w / scale rounded to the
    nearest e4m3 value (a zero channel gets scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q, scale, out_dtype=out_dtype or w.dtype)


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  symmetric: bool = True, out_dtype: torch.dtype | None = None
                  ) -> QuantizedWeight:
    """Groups of group_size along K, round to nearest. Symmetric: scale = max|w| / 7.5 over
    the group (so the range spans -8..7 like the codes), q = clamp(round(w / scale), -8, 7).
    Asymmetric: scale = (max - min) / 15 with min <= 0 <= max, zero = clamp(-8 - round(min /
    scale)), q = clamp(round(w / scale) + zero)."""
    n, k = w.shape
    if not plane_group(group_size) or k % group_size or k % PLANE_BLOCK:
        raise ValueError(f"group_size={group_size} must be 16, 32 or a multiple of "
                         f"{PLANE_BLOCK}, dividing the input dim {k} (a multiple of "
                         f"{PLANE_BLOCK})")
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = g.abs().amax(dim=2) / ((INT4_MAX - INT4_MIN) / 2)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(g / scale[..., None]).clamp(INT4_MIN, INT4_MAX)
        zero = None
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = (hi - lo) / (INT4_MAX - INT4_MIN)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = (INT4_MIN - torch.round(lo / scale)).clamp(INT4_MIN, INT4_MAX)
        q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(INT4_MIN, INT4_MAX)
        zero = zero.to(torch.int8)
    return QuantizedWeight("int4", pack_planes(q.reshape(n, k).to(torch.int8)), scale, zero,
                           group_size, out_dtype=out_dtype or w.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in -8..7, [N, K] -> [N, K / 8] int32, value j of a word at bits 4j (K order:
    compressed-tensors' pack-quantized layout)."""
    n, k = q.shape
    u = (q.to(torch.int64) + 8).reshape(n, k // PACK, PACK)
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int64, device=q.device)
    words = (u << shifts).sum(dim=2)
    # the word's bit pattern as a signed int32 (the top nibble reaches the sign bit)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 8] int32 -> [N, K] int8 codes in -8..7."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=packed.device)
    u = (packed[..., None] >> shifts) & 0xF
    return (u - 8).reshape(packed.shape[0], -1).to(torch.int8)


def pack_planes(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in -8..7, [N, K] -> [N, K / 8] int32 in plane order (the module docstring):
    K order within each 64-column block (plane j, column e) becomes (e, j)."""
    n, k = q.shape
    b = PLANE_BLOCK
    return pack_int4(q.reshape(n, k // b, 4, b // 4).transpose(2, 3).reshape(n, k))


def unpack_planes(packed: torch.Tensor) -> torch.Tensor:
    """pack_planes undone: [N, K / 8] int32 -> [N, K] int8 codes."""
    q = unpack_int4(packed)
    n, k = q.shape
    b = PLANE_BLOCK
    return q.reshape(n, k // b, b // 4, 4).transpose(2, 3).reshape(n, k)


def dequantize(w: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense [N, K] weight in `dtype` (default the activation dtype), computed in fp32."""
    dtype = dtype or w.out_dtype
    if w.format == "fp8":
        return (w.data.float() * w.scale[:, None]).to(dtype)
    q = unpack_planes(w.data).float()
    n, k = q.shape
    q = q.reshape(n, k // w.group_size, w.group_size)
    if w.zero is not None:
        q = q - w.zero.float()[..., None]
    return (q * w.scale[..., None]).reshape(n, k).to(dtype)
