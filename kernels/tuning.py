"""Every tunable of the kernel layer in one typed table: row limits that pick a kernel, split
counts, tile sizes, L2 prefetch sizes. `tuning_for(device)` gives the table for a GPU; the code
that picks the op set (kernels.select_ops) hands it on, and no other module in kernels/ holds a
tunable constant. docs/architecture.md gives the measurements behind the values."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class LinearConfig:
    """One launch of the projection kernel (kernels/linear_triton.py)."""
    block_m: int  # 1: CUDA-core dot products (M == 1 only); >= 16: tensor-core tl.dot
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        pow2 = lambda v: v >= 1 and v & (v - 1) == 0
        dims = (self.block_m, self.block_n, self.block_k)
        if not all(pow2(v) for v in dims) or (self.block_m > 1 and min(dims) < 16):
            raise ValueError(f"LinearConfig blocks must be powers of two, and at least 16 for "
                             f"tensor-core dots (block_m > 1); got {dims}")
        if self.split_k < 1:
            raise ValueError(f"LinearConfig split_k must be >= 1, got {self.split_k}")


@dataclass(frozen=True)
class L2Prefetch:
    """Bytes of the next projection's weight a Triton projection warms in L2
    (kernels/l2_prefetch.py), by the kind of projection that asks; "one_row": every projection
    of a one-row batch. Past a few MiB the hints crowd out the kernels' own loads."""
    qkv: int = 3 << 20
    o: int = 3 << 20
    gate_up: int = 3 << 20
    down: int = 3 << 20
    one_row: int = 4 << 20

    def bytes_for(self, kind: str) -> int:
        return getattr(self, kind, 0)


@dataclass(frozen=True)
class LinearTuning:
    """The projections (kernels/linear*.py, kernels/triton_ops.py)."""
    # Row limits that pick who runs a projection.
    max_rows: int = 64  # the small-M kernels' limit: above it the step is a GEMM (cuBLAS)
    # Prologue fusion (norm, silu * mul) pays only for one row: above, every program re-reads
    # the rows.
    fuse_max_rows: int = 1
    auto_max_rows: int = 1  # projections="auto": Triton for batches up to this many rows
    # The epilogue-fused projections (residual add, silu * mul, the next norm begun) for
    # batches of fused_min_rows..fused_max_rows rows.
    fused_min_rows: int = 33
    fused_max_rows: int = 64
    # The widest weights (the LM head of every preset) stay on Triton, after the separate norm
    # kernel, up to wide_max_rows rows (a batch-1 speculative verify has K + 1 <= 9 rows).
    wide_weight_rows: int = 65536
    wide_max_rows: int = 16
    # A fused batch's qkv projection on Triton (not cuBLAS) for weights of up to this many
    # elements, so the attention after it may fetch its first KV tile before its PDL wait; a
    # tensor-parallel rank's qkv, whose input the all-reduce normed, up to rank_qkv_max_elements.
    fused_qkv_max_elements: int = 8 << 20
    rank_qkv_max_elements: int = 16 << 20
    l2_prefetch: L2Prefetch = field(default_factory=L2Prefetch)
    # pick_config: one row on CUDA cores, 8 columns x 1024-wide K steps, but 4 x 2048 for a K of
    # one_row_long_k or more (the down projections), where 1024-wide steps doubled each
    # program's serial walk; with the norm fused in, one_row_norm.
    one_row: LinearConfig = LinearConfig(1, 8, 1024)
    one_row_long: LinearConfig = LinearConfig(1, 4, 2048)
    one_row_long_k: int = 8192
    one_row_norm: LinearConfig = LinearConfig(1, 8, 1024)
    # pick_config above one row: tensor-core tiles; wide N tiles for weights of wide_n+ rows;
    # K split (when longer than N) until there are split_programs programs.
    wide_n: int = 16384
    split_programs: int = 256
    split_sum_block: int = 1024  # columns per program of the split-K sum kernel
    # pick_fused_config: the epilogue-fused projections' tiles at 33-64 rows.
    fused_gate_up: LinearConfig = LinearConfig(64, 32, 64, 1, num_warps=4, num_stages=5)
    fused_lm_head: LinearConfig = LinearConfig(64, 128, 128, 1, num_warps=4, num_stages=3)
    fused_qkv_programs: int = 96  # qkv: columns per program for about this many programs
    fused_add_programs: int = 128  # o and down (residual epilogue): the same
    # invariant_config: one tile per weight shape whatever the row count (batch_invariant).
    invariant_block_n: int = 32
    invariant_block_k: int = 128
    invariant_split_programs: int = 264


@dataclass(frozen=True)
class QuantLinearTuning:
    """The quantized projections, W8A16 and W4A16 (kernels/linear_quant_triton.py): tiles from
    tools/lab/tune_quant_linear.py, steps timed by tools/bench.py decode --quantization."""
    # Above max_rows an int4 weight is dequantized into a dense copy and cuBLAS runs the GEMM
    # (fp8 runs W8A8 there): a prefill chunk's many rows amortise the copy, and the kernel's
    # tiles are decode-sized.
    max_rows: int = 64
    # The norm before qkv and gate_up, and silu * mul before down, in the kernel's prologue up
    # to this many rows (as LinearTuning.fuse_max_rows); above, their own kernels run first.
    fuse_max_rows: int = 1
    # fp8 with the norm fused and K not split: the norm in one pass over the row (1 / rms
    # applied to the finished sums), as LinearTuning's projections do.
    one_pass_norm: bool = True
    # Whether tensor-core tiles (int4 at any row count, fp8 W8A16 from 2 rows) launch as
    # programmatic dependents (kernels/pdl.py); fp8's one-row CUDA-core kernel always does.
    # Once the epilogues took the norms and split-K sums, a quantized projection's dependent
    # was the next one: its programs, resident early and waiting, held the shared memory the
    # running kernel's later waves needed. llama-8b on an H100, int4 at batch 1 / 16 / 64:
    # 3.068 / 3.739 / 5.550 ms without, 3.933 / 3.742 / 6.521 with; fp8 at 16: 4.308
    # against 4.645; fp8 at one row: 3.227 with, 3.344 without.
    pdl_tensor_cores: bool = False
    # Bytes of the next projection's weight each quantized projection warms in L2 once its
    # own loads are issued (kernels/l2_prefetch.py; LinearTuning.l2_prefetch for bf16).
    # llama-8b on an H100, fp8 / int4 at batch 1, 16, 64 (ms): none 3.232 4.464 4.705 /
    # 3.055 3.702 5.516; 2 MiB 3.163 4.417 4.640 / 3.001 3.671 5.497; 4 MiB 3.133 4.336 4.629
    # / 2.979 3.593 5.450; 8 MiB 3.255 4.303 4.730 / 3.035 3.592 5.595.
    l2_prefetch_bytes: int = 4 << 20
    # The dense copy's kernel (kernels/dequant_triton.py): a program's tile.
    dequant_block_n: int = 16
    dequant_block_k: int = 256
    # fp8 weights from this many rows on run W8A8 on the fp8 tensor cores (the activations
    # quantized per row by the norm or activation kernel, torch._scaled_mm:
    # kernels/linear_fp8_rows.py); 0: never. On an H100 (tools/lab/time_fp8_w8a8.py), llama-8b's
    # four projections took 113 us against W8A16's 177 at 32 rows and 112 against 183 at 64;
    # even at 16 (118 against 121), and above 64 rows 2-3x faster than the dense copy.
    # W8A8 adds three quantizing launches a layer (o's input, and the norms that W8A16's
    # epilogues begin and its next projection finishes); the H200 table below sets 2.
    fp8_scaled_mm_min_rows: int = 17
    # W8A8's GEMM up to this many rows (kernels/linear_w8a8_triton.py), torch._scaled_mm
    # above: cuBLASLt's 128-column tiles leave most SMs idle on a decode batch. Its tile:
    # every row, 128 columns up to w8a8_few_rows_max rows or for weights of wide_n+ rows, 64
    # otherwise, K split until the programs reach w8a8_programs: the best tile, or within
    # 0.1 us of it, of each llama-8b projection at 32 and 64 rows on an H100
    # (tools/lab/w8a8_triton.py).
    w8a8_triton_max_rows: int = 64
    w8a8_few_rows_max: int = 32
    w8a8_block_n_wide: int = 128
    w8a8_block_n: int = 64
    w8a8_block_k: int = 256
    w8a8_stages: int = 4
    w8a8_warps: int = 4
    w8a8_few_rows_warps: int = 4  # up to w8a8_few_rows_max rows
    w8a8_programs: int = 96
    # K is split (each output tile's last program to finish sums the fp32 partials in a fixed
    # order) until there are split_programs programs.
    split_programs: int = 264
    # Tiles by row count, measured on an H100 with llama-8b's projections
    # (tools/lab/tune_quant_linear.py): one row on CUDA cores; up to few_rows_max rows 16-row
    # tensor-core tiles; then 64-row tiles, wider in N for weights of wide_n+ rows (gate_up),
    # where narrow tiles re-read the rows from L2 once per column block. fp8 at 2-16 rows in
    # 128-deep tiles, four stages: gate_up took 59.4 us in 256-deep ones with three (47.1 /
    # 47.8 in 128 / 256 with four), the others the same within 0.8 us; llama-8b's fp8 step
    # at 16 rows 4.031 ms against 4.339 (4.057 in 256 with four stages, 4.164 in 128 with
    # three), one H100, one call. One row in 16 x 512 tiles: 3.186 ms against 3.137.
    few_rows_max: int = 16
    wide_n: int = 16384
    one_row: LinearConfig = LinearConfig(1, 8, 1024)
    one_row_wide: LinearConfig = LinearConfig(1, 8, 1024)  # fp8, one row, N >= wide_n
    few_rows: LinearConfig = LinearConfig(16, 32, 128, num_stages=4)
    many_rows: LinearConfig = LinearConfig(64, 32, 128)
    many_rows_wide: LinearConfig = LinearConfig(64, 128, 128)
    # int4: tensor-core tiles only (one row padded to 16), block_k cut to the group. Up to
    # few_rows_max rows K splits in powers of two while every program keeps
    # int4_min_split_steps K steps and columns x splits stay within int4_split_columns (the
    # programs' occupancy hides the unpacking's latency, a longer loop its pipeline fill); more
    # rows split until int4_many_rows_programs programs. llama-8b's projections on an H100
    # (tools/lab/tune_quant_linear.py --formats int4), us at 1 / 16 rows for qkv, o, gate_up,
    # down: 9.6 8.1 35.0 21.0 / 11.0 13.0 37.9 25.6 with four splits at one row and 264
    # programs above; the rule picks the best tile's split for each (9.5 7.6 31.7 17.0 / 11.3
    # 8.5 33.4 19.6). 64 rows: 5.66 ms a step with 132 programs, 6.69 with 264. gate_up in 256
    # columns and 8 warps at 64 rows: 48.5 us against 56.8 alone, yet the step lost 6% at 32
    # rows for 2% at 64.
    int4_one_row: LinearConfig = LinearConfig(16, 64, 128)
    int4_few_rows: LinearConfig = LinearConfig(16, 128, 128)
    int4_many_rows: LinearConfig = LinearConfig(64, 128, 128)
    int4_many_rows_programs: int = 128
    int4_min_split_steps: int = 8
    int4_split_columns: int = 32768

    def config_for(self, m: int, n: int, int4: bool) -> LinearConfig:
        """The tile for m rows of a weight with n output columns."""
        wide = n >= self.wide_n and not int4
        kind = ("one_row_wide" if m == 1 and wide else "one_row" if m == 1
                else "few_rows" if m <= self.few_rows_max
                else "many_rows_wide" if wide else "many_rows")
        return getattr(self, ("int4_" if int4 else "") + kind)


@dataclass(frozen=True)
class ElementwiseTuning:
    """RMSNorm, rotary embedding and silu * mul (kernels/norm_rope_triton.py,
    kernels/activation_triton.py)."""
    # A norm program holds tile_elements / (the padded row width) rows, at most norm_max_rows:
    # rows per program from the row width only, so a row is reduced the same way whatever the
    # batch (batch-invariant). Rows of norm_wide_d+ elements take norm_wide_warps warps.
    tile_elements: int = 4096
    norm_max_rows: int = 64
    norm_wide_d: int = 4096
    norm_wide_warps: int = 8
    # Rotary embedding: heads a loop step rotates, up to tile_elements / (half the padded head
    # dim); silu * mul: columns a program takes. The rest launch with `warps` warps.
    silu_block: int = 2048
    warps: int = 4


@dataclass(frozen=True)
class CollectiveTuning:
    """The tensor-parallel all-reduce and gather (kernels/all_reduce_triton.py,
    kernels/gather_triton.py, graphexec/parallel/symmetric.py)."""
    # Above this message size at two ranks (half at four, ...) an all-reduce goes to NCCL: the
    # one-shot kernel sends the whole message to each peer, cheap for small ones only.
    one_shot_bytes_at_size_2: int = 4 << 20
    # A rank's landing zone for the LM head's gather holds a box this large per rank: a 64-row
    # bf16 slice of up to 131,072 columns.
    gather_box_bytes: int = 16 << 20
    # The all-reduce kernel: 4-byte words a program sends (2 KiB of data, four words a thread
    # at four warps), and its warps.
    all_reduce_block: int = 512
    all_reduce_warps: int = 4
    # The fused all-reduce + norm: a row's words over 4-16 warps, this many words a thread.
    norm_words_per_thread: int = 8


@dataclass(frozen=True)
class AttentionTuning:
    """Decode and prefill attention (kernels/attention_decode_triton.py,
    attention_prefill_triton.py, attention_merge_triton.py)."""
    # Flash-decoding's split count: enough programs to fill the GPU split_waves times over (two
    # splits a row where one filled it already lost at tensor_parallel_size 2), at most
    # max_splits a row, and no split of fewer than min_tiles_per_split key tiles.
    split_waves: int = 1
    max_splits: int = 64
    min_tiles_per_split: int = 1
    # Where a program per (row, KV head) fills the GPU already, a row still splits into runs
    # of long_split_tiles key tiles, at most long_max_splits (0: no split): serving's contexts
    # of 16-2,500 tokens otherwise left the longest rows' programs running alone. llama-8b,
    # the offline serving workload, one H100: 4,466 against 4,344 out tok/s (bf16); the
    # 128 + 128 batch-64 step the same (6.497 against 6.506 ms).
    long_split_tiles: int = 8
    long_max_splits: int = 16
    # A mixed step's decode rows (capture/mixed.py) size their split count as for this many
    # rows (0: the decode part's static size, min(max_batch, token bucket) places, most of
    # them inert rows that stop after one tile): at the default max_batch of 64 that was one
    # split, and a few rows with long contexts walked them in one program per head. llama-1b,
    # H100 (tools/bench_mixed_step.py): a mixed step beside 2 rows at 4,000 tokens 3.23 ->
    # 2.00 ms, beside 48 rows at 1,000 tokens 3% slower.
    mixed_split_rows: int = 8
    # Decode keys per tile: decode_block_n, or decode_narrow_block_n for head dims over
    # large_head_dim and, for head dims up to small_head_dim, batches of at most
    # short_tile_max_rows rows (a short batch gets twice the splits, each its prefetched tile).
    decode_block_n: int = 64
    decode_narrow_block_n: int = 32
    short_tile_max_rows: int = 4
    small_head_dim: int = 64
    large_head_dim: int = 128
    # Decode warps: decode_small_head_warps for head dims up to small_head_dim below
    # four_warps_min_rows rows (always, for the batch-invariant kernels), else decode_warps.
    decode_warps: int = 4
    decode_small_head_warps: int = 2
    four_warps_min_rows: int = 33
    decode_stages: int = 3
    # An fp8 cache's tiles past short_tile_max_rows rows (not narrowed as above): half the
    # bytes and converted in registers, they pay in 128 keys over two stages. llama-8b heads,
    # one H200, 2026-12-01 (tools/lab/time_decode_attention.py), us a layer: serving's
    # contexts (mean 387-533 tokens) at 16 / 46 / 64 rows 18.6 / 40.9 / 56.5 against 22.7 /
    # 50.2 / 69.1 in 64 keys over three (bf16's cache: 24.4 / 44.4 / 57.6); 192 tokens at 16
    # / 64 rows 8.4 / 28.4 against 8.8 / 38.1, but at one row 7.2 against 5.9 (fewer splits).
    # Lost there (one H200, 2026-12-02, dc13c96, 46 / 64 rows against 40.9 / 56.7): shorter
    # splits (long_split_tiles 4: 43.1 / 62.0; 2: 64.2 / 92.6), 8 warps (60.7 / 86.2); the
    # keys, or keys and values, as the dots' left operands (s.T = k @ q.T on wgmma, the fp8
    # tile converted in registers; e54ee18): 49.1 / 68.8 and 52.0 / 72.1 against 40.7 / 56.4.
    decode_fp8_block_n: int = 128
    decode_fp8_stages: int = 2
    # Up to this many rows the fused rope + attention loads its first KV tile before its PDL
    # wait, overlapping the qkv projection's tail (which only a Triton projection lets it do).
    prefetch_max_rows: int = 4
    # The split merge holds [heads, splits, head dim] fp32 partials of this many elements at once.
    merge_elements: int = 4096
    # Batch-invariant kernels: splits a row from the block table's width alone, and query
    # tokens per decode launch of the invariant prefill (bounds the split workspaces).
    invariant_splits: int = 16
    invariant_prefill_chunk: int = 512
    # Prefill: query rows per tile (fewer, a power of two from 16, for a smaller batch), keys
    # per tile (prefill_narrow_block_n for fp32 dots and head dims over large_head_dim).
    prefill_block_m: int = 64
    prefill_block_n: int = 64
    prefill_narrow_block_n: int = 32
    prefill_warps: int = 4
    prefill_stages: int = 2


@dataclass(frozen=True)
class SamplingTuning:
    """Sampling and argmax (kernels/sampling_triton.py). Any values give the same tokens (the
    tests shrink them to send rows down every path): they set how much of a row a program takes
    and how large a candidate set the exact sort handles before the radix fallback."""
    chunk: int = 2048  # kernel 1 (and argmax): entries of a row per program
    sub: int = 256  # kernel 1: a sub-chunk ("unit") gives top_r entries to the table
    top_r: int = 1
    cap: int = 2048  # candidates kernel 2 sorts in registers
    small_cap: int = 256  # a smaller sort for the usual case (top-k in the tens)
    scan_block: int = 256  # kernel 2: width of a unit re-read
    fb_block: int = 2048  # kernel 2: width of the fallback's passes ([fb_block, 2**bits])
    fb_radix_bits: int = 2  # bits of the threshold the fallback settles per pass over the row
    chunk_warps: int = 4
    select_warps: int = 16  # kernel 2: more warps hide the fallback passes' latency
    # min_p (kernels/penalties_triton.py) and grammar masks (kernels/token_mask_triton.py):
    # vocabulary entries a program (a pass of min_p's) takes, and its warps, the penalties'
    # too; penalty_list_block: entries of a slot's list of seen tokens a penalties pass takes.
    penalty_block: int = 2048
    penalty_warps: int = 4
    penalty_list_block: int = 512
    # Grammar masks copied from pinned memory once the host releases them
    # (kernels/mask_gate_triton.py): int64 words of a row a program copies at a time.
    mask_copy_block: int = 2048


@dataclass(frozen=True)
class Tuning:
    linear: LinearTuning = field(default_factory=LinearTuning)
    quant_linear: QuantLinearTuning = field(default_factory=QuantLinearTuning)
    collective: CollectiveTuning = field(default_factory=CollectiveTuning)
    elementwise: ElementwiseTuning = field(default_factory=ElementwiseTuning)
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    sampling: SamplingTuning = field(default_factory=SamplingTuning)


# Measured on an H100 (and, for the attention and serving figures, an H200); a GPU without a
# table of its own below takes these.
DEFAULT = Tuning()

# An H200 streams a weight about 1.3x as fast as an H100 from the same 132 SMs, so a projection
# kernel needs more bytes in flight a program and, for the small weights, more programs: its
# quantized tiles come from tools/lab/tune_quant_linear.py on one H200 (2026-12-02), and fp8
# runs W8A8 from 2 rows there, where it beat W8A16 in llama-8b's step (the per-projection times
# and the steps either way: docs/benchmarks.md), in tiles of 8 warps up to 32 rows (8 lost at 64).
H200 = replace(DEFAULT, quant_linear=replace(
    DEFAULT.quant_linear,
    fp8_scaled_mm_min_rows=2,
    w8a8_few_rows_warps=8,
    one_row_wide=LinearConfig(1, 8, 512),
    few_rows=LinearConfig(16, 32, 256, num_stages=3),
    int4_one_row=LinearConfig(16, 128, 128, num_stages=4),
    int4_few_rows=LinearConfig(16, 128, 128, num_stages=4),
    int4_min_split_steps=4,
    int4_split_columns=49152,
    int4_many_rows=LinearConfig(32, 256, 128)))

# Tables by a substring of torch.cuda.get_device_name.
BY_GPU: dict[str, Tuning] = {"H200": H200}


def tuning_for(device: torch.device) -> Tuning:
    """The table for `device`: its GPU's own (BY_GPU), else DEFAULT."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, table in BY_GPU.items():
            if key in name:
                return table
    return DEFAULT
