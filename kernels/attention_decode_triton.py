"""Triton paged decode attention (flash-decoding): each row's context is cut into splits run
by separate programs and merged in the kernel (kernels/attention_merge_triton.py); the fused
variant also rotates q and k and writes the new token's K/V (rope_decode_attention). PyTorch
references: kernels/attention.py. Layout and grids: kernels/attention_tiles_triton.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_tiles_triton as tiles
from . import pdl
from .attention_merge_triton import _merge_splits, _store_normalized
from .attention_tiles_triton import LOG2E, attend_tile, ieee_dot, load_kv_tile
from .norm_rope_triton import rotate_pair
from .tickets import ticket_counters
from .tuning import DEFAULT, AttentionTuning
from .write_kv_triton import _cache_ok

# Multiprocessors per CUDA device index, read once: a device property, not a setting.
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, out_ptr, po_ptr, pm_ptr, pl_ptr,
                         cnt_ptr, kn_ptr, vn_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                         qk_scale, G, D, NUM_SPLITS, MIN_TILES,
                         sq0, sq1, skb, sks, skh, svb, svs, svh, sbt0, so0, so1,
                         skn0, skn1, svn0, svn1, sc0,
                         BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_GR: tl.constexpr,
                         MERGE_SPLITS: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
                         ROPE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """One program: batch row b, KV head kh (all G query heads of it), split sp of the context.
    A row uses n_split = min(NUM_SPLITS, cdiv(tiles, MIN_TILES)) splits, read on the device
    from its length: the context [0, seq_len) is cut into n_split equal runs of whole BLOCK_N
    tiles, so the work follows the real length while the grid depends on shapes only, and a
    short row runs on few programs (the others find an empty range and store nothing). Scores
    are in log2 units (qk_scale includes log2(e)).

    One split normalises and stores its output. Several store partial (max, sum, acc) results;
    each then takes a ticket from the row's counter (cnt_ptr[b, kh]), and the program that
    draws the last ticket merges the partials in split order and resets the counter to 0 for
    the next launch. The merge is the same whichever program ends last, so results stay
    deterministic.

    ROPE: q, and the row's new k (kn) and v (vn), arrive unrotated; every program rotates its q
    heads, and the program whose split holds the new token's position rotates k and writes k
    and v to the row's slot before its loop reads them back (split 0 writes a token at or past
    seq_len, which nobody reads). PREFETCH (with ROPE): the split's first tile is loaded
    first, before the PDL wait, and the owner puts the new token into it from registers.
    Contract (rope_decode_attention): each row is its own sequence and its slot lies in its
    own blocks, so no program reads another row's new token. Padding rows are the exception
    that does no harm: they all write identical K/V into the one scratch slot and read it
    back, and their outputs are discarded."""
    if not PREFETCH:
        pdl.prologue(PDL)
    elif PDL:
        # Before the wait, read only what the kernels before this forward's first launch wrote:
        # that launch (the embedding gather) is a normal one, so they have all completed. The
        # step's metadata (seq_lens, positions, slots, block tables) and every key and value
        # but the new token's are such; q and the new k, v (the projection just before) are not.
        pdl.gdc_launch_dependents()
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(sl_ptr + b)
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    n_split = tl.minimum(tl.maximum(tl.cdiv(n_tiles, MIN_TILES), 1), NUM_SPLITS)
    tiles_per = tl.cdiv(n_tiles, n_split)
    start = sp * tiles_per * BLOCK_N
    end = tl.minimum(start + tiles_per * BLOCK_N, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    gmask = g < G
    dmask = d < D
    heads = (kh * G + g).to(tl.int64)
    kh64 = kh.to(tl.int64)
    bt_row = bt_ptr + b64 * sbt0
    first = start
    if PREFETCH:  # the split's first tile, as the loop would load it
        k_pre, v_pre = load_kv_tile(k_ptr, v_ptr, bt_row, start + n, end, d, dmask, kh64,
                                    skb, sks, skh, svb, svs, svh, BLOCK_SIZE)
        new_pos_pre = tl.load(pos_ptr + b).to(tl.int64)
        new_slot_pre = tl.load(slot_ptr + b).to(tl.int64)
        if PDL:
            pdl.gdc_wait()
        first = start + BLOCK_N
    if ROPE:  # the wrapper guarantees D == BLOCK_D (a power of two)
        HALF: tl.constexpr = BLOCK_D // 2
        dh = tl.arange(0, HALF)
        if PREFETCH:
            new_pos = new_pos_pre
        else:
            new_pos = tl.load(pos_ptr + b).to(tl.int64)
        cos_v = tl.load(cos_ptr + new_pos * sc0 + dh)
        sin_v = tl.load(sin_ptr + new_pos * sc0 + dh)
        q_src = q_ptr + b64 * sq0 + heads[:, None] * sq1 + dh[None, :]
        x1 = tl.load(q_src, mask=gmask[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(q_src + HALF, mask=gmask[:, None], other=0.0).to(tl.float32)
        r1, r2 = rotate_pair(x1, x2, cos_v[None, :], sin_v[None, :])
        # [r1 | r2] along the head dim, as the separate rope kernel would have stored q
        q = tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_G, BLOCK_D))
        q = q.to(q_ptr.dtype.element_ty)
        if PREFETCH:
            new_slot = new_slot_pre
        else:
            new_slot = tl.load(slot_ptr + b).to(tl.int64)
        owner = ((new_pos >= start) & (new_pos < end)) | ((new_pos >= seq_len) & (sp == 0))
        if owner & (new_slot >= 0):  # a negative slot: no write
            k_src = kn_ptr + b64 * skn0 + kh64 * skn1 + dh
            k1, k2 = rotate_pair(tl.load(k_src).to(tl.float32),
                                 tl.load(k_src + HALF).to(tl.float32), cos_v, sin_v)
            k1 = tiles.to_cache(k1, k_ptr)
            k2 = tiles.to_cache(k2, k_ptr)
            # a flat slot addresses the cache directly (_cache_ok: blocks evenly strided)
            k_dst = k_ptr + new_slot * sks + kh64 * skh + dh
            tl.store(k_dst, k1)
            tl.store(k_dst + HALF, k2)
            v_new = tiles.to_cache(tl.load(vn_ptr + b64 * svn0 + kh64 * svn1 + d), v_ptr)
            tl.store(v_ptr + new_slot * svs + kh64 * svh + d, v_new)
            if PREFETCH:
                # the prefetched tile predates the new token: put it in where the tile holds
                # its position (the row's own slot, by the contract of rope_decode_attention)
                is_new = ((start + n) == new_pos)[:, None]
                k_row = tl.reshape(tl.permute(tl.join(k1, k2), (1, 0)), (BLOCK_D,))
                k_pre = tl.where(is_new, k_row[None, :], k_pre)
                v_pre = tl.where(is_new, v_new[None, :], v_pre)
            tl.debug_barrier()  # the whole program sees the new token before the loop
    else:
        q = tl.load(q_ptr + b64 * sq0 + heads[:, None] * sq1 + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
    q = tiles.dot_operand(q, k_ptr)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if PREFETCH:
        if start < end:
            m_i, l_i, acc = attend_tile(q, k_pre, v_pre, ((start + n) < end)[None, :], m_i,
                                        l_i, acc, qk_scale, IEEE)
    for n0 in range(first, end, BLOCK_N):
        pos = n0 + n
        k, v = load_kv_tile(k_ptr, v_ptr, bt_row, pos, end, d, dmask, kh64,
                            skb, sks, skh, svb, svs, svh, BLOCK_SIZE)
        m_i, l_i, acc = attend_tile(q, k, v, (pos < end)[None, :], m_i, l_i, acc, qk_scale,
                                    IEEE)

    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        _store_normalized(out_ptr, b64 * so0 + heads[:, None] * so1 + d[None, :], acc, l_i,
                          omask)
    elif sp < n_split:
        if n_split == 1:
            _store_normalized(out_ptr, b64 * so0 + heads[:, None] * so1 + d[None, :], acc, l_i,
                              omask)
        else:
            # partials: [B, Hq, NUM_SPLITS] for m and l, [B, Hq, NUM_SPLITS, BLOCK_D] for acc.
            # Every split of the row writes, empty ones too (m = -inf, l = 0, acc = 0).
            row = (b64 * (G * tl.num_programs(1)) + heads) * NUM_SPLITS + sp
            tl.store(pm_ptr + row, m_i, mask=gmask)
            tl.store(pl_ptr + row, l_i, mask=gmask)
            tl.store(po_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=omask)
            # every warp's stores are issued before the ticket's release makes them visible
            tl.debug_barrier()
            counter = cnt_ptr + b64 * tl.num_programs(1) + kh64
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_split - 1:
                _merge_splits(po_ptr, pm_ptr, pl_ptr, out_ptr, b64, kh64, G, D, NUM_SPLITS,
                              n_split, tl.num_programs(1), so0, so1, BLOCK_GR, BLOCK_D,
                              MERGE_SPLITS)
                tl.store(counter, 0)


def _decode_num_splits(b: int, hk: int, max_blocks: int, block_size: int, block_n: int,
                       device: torch.device,
                       tuning: AttentionTuning = DEFAULT.attention) -> int:
    """From host-known sizes only: enough programs to fill the GPU tuning.split_waves times
    over, no more splits than tiles the block table can address. Where the rows fill it
    alone, splits for the long contexts only (_decode_min_tiles): a row of runs of
    long_split_tiles tiles each, up to long_max_splits."""
    max_tiles = max(1, triton.cdiv(max_blocks * block_size, block_n))
    if _rows_fill(b, hk, device, tuning):
        return max(1, min(triton.cdiv(max_tiles, tuning.long_split_tiles),
                          tuning.long_max_splits))
    splits = triton.cdiv(tuning.split_waves * _sm_count(device), max(1, b * hk))
    return max(1, min(splits, max_tiles, tuning.max_splits))


def _rows_fill(b: int, hk: int, device: torch.device, tuning: AttentionTuning) -> bool:
    """Whether a program per (row, KV head) fills the GPU tuning.split_waves times over (and
    long contexts are split by length: tuning.long_split_tiles > 0)."""
    return tuning.long_split_tiles > 0 and b * hk >= tuning.split_waves * _sm_count(device)


def _decode_min_tiles(b: int, hk: int, device: torch.device,
                      tuning: AttentionTuning = DEFAULT.attention) -> int:
    """The fewest key tiles a split takes, with _decode_num_splits's count. One where splits
    fill the GPU; where the rows fill it alone, long_split_tiles: a short row stays whole,
    and a long one no longer keeps its program running long after the others finished."""
    return tuning.long_split_tiles if _rows_fill(b, hk, device, tuning) else (
        tuning.min_tiles_per_split)


def _decode_blocks(d: int, rows: int | None = None,
                   tuning: AttentionTuning = DEFAULT.attention,
                   fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, stages): the head dim padded, keys per tile and the loop's stages.
    rows: the batch, None for the batch-invariant kernels (whose tiles must not depend on it);
    fp8: an fp8 cache."""
    block_d = max(16, triton.next_power_of_2(d))
    short = (rows is not None and rows <= tuning.short_tile_max_rows
             and block_d <= tuning.small_head_dim)
    if short or block_d > tuning.large_head_dim:
        return block_d, tuning.decode_narrow_block_n, tuning.decode_stages
    if fp8 and (rows is None or rows > tuning.short_tile_max_rows):
        return block_d, tuning.decode_fp8_block_n, tuning.decode_fp8_stages
    return block_d, tuning.decode_block_n, tuning.decode_stages


def decode_attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, split_rows: int | None = None, *,
                               tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """decode_attention with the split count taken from the block table's width only, never
    from the batch: a row's context is cut at the same places (they depend on its length and
    the split count) whether it runs with 1 row or 320, as a draft row or a verify row.
    split_rows is ignored for that reason."""
    _, block_n, _ = _decode_blocks(q.shape[-1], tuning=tuning, fp8=tiles.is_fp8(k_cache))
    max_tiles = max(1, triton.cdiv(block_tables.shape[1] * k_cache.shape[1], block_n))
    return decode_attention_splits(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                   min(max_tiles, tuning.invariant_splits), invariant=True,
                                   tuning=tuning)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, split_rows: int | None = None, *,
                     tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """q: [B, Hq, D]; block_tables [B, M] int32; seq_lens [B] int32 (>= 1). -> [B, Hq, D].
    split_rows: size the split count as for a batch of that many rows (decode_attention_splits)."""
    return decode_attention_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, None,
                                   split_rows=split_rows, tuning=tuning)


def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float,
                          prefetch: bool | None = None,
                          split_rows: int | None = None, *,
                          tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """rope_write_kv + decode_attention in one launch (attention.rope_decode_attention_ref):
    saves a kernel per layer and the rotated q's round trip through memory. Each row must be a
    different sequence whose slot lies in its own blocks (the decode step's rows: position
    seq_len - 1, slot from the row's block table); rows that read each other's new tokens
    (the speculative verify) must call rope_write_kv and decode_attention instead. prefetch:
    load the first KV tile before the PDL wait (None: up to tuning.prefetch_max_rows rows); it
    pays where the kernel before is a Triton projection that lets dependents start early."""
    return decode_attention_splits(q, k_cache, v_cache, block_tables, seq_lens, scale, None,
                                   rope=(k, v, positions, cos, sin, slot_mapping),
                                   prefetch=prefetch, split_rows=split_rows, tuning=tuning)


def decode_attention_splits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            num_splits: int | None, rope: tuple | None = None,
                            min_tiles: int | None = None, invariant: bool = False,
                            prefetch: bool | None = None,
                            split_rows: int | None = None, *,
                            tuning: AttentionTuning = DEFAULT.attention) -> torch.Tensor:
    """decode_attention with the split count forced (tests, tuning); None picks it from the
    shapes, as for a batch of split_rows rows when given (a mixed step's decode part, whose
    places are mostly inert rows that exit after one tile: capture/mixed.py). A row uses at
    most that many splits, and no more than one per min_tiles tiles of its context (when
    None: _decode_min_tiles's with a picked count, else tuning.min_tiles_per_split).
    rope = (k, v, positions, cos, sin, slot_mapping): q, k unrotated, and the new k, v written
    by the kernel (rope_decode_attention). invariant: tiles that do not depend on the batch."""
    b, hq, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    # fused: the cache's dtype or fp8 (the write converts) and a power-of-two head dim (q is
    # rotated as two halves of BLOCK_D / 2 lanes)
    fusable = rope is None or (
        (tiles.is_fp8(k_cache) or rope[0].dtype == k_cache.dtype)
        and (tiles.is_fp8(v_cache) or rope[1].dtype == v_cache.dtype)
        and d >= 16 and d & (d - 1) == 0)
    if not (_cache_ok(k_cache) and _cache_ok(v_cache) and fusable):
        from .attention import paged_decode_attention_ref
        if rope is not None:
            from .norm_rope_triton import rope_write_kv
            k, v, positions, cos, sin, slots = rope
            q = rope_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
            rope = None
        if not (_cache_ok(k_cache) and _cache_ok(v_cache)):
            return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = tiles._new((b, hq, d), q.dtype, q.device)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if rope is None:
        kn = vn = pos = slots = cos = sin = q  # unused
        rope_strides = (0, 0, 0, 0, 0)
    else:
        kn, vn, pos, cos, sin, slots = rope
        kn = kn if kn.stride(-1) == 1 else kn.contiguous()
        vn = vn if vn.stride(-1) == 1 else vn.contiguous()
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        rope_strides = (kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos.stride(0))
    g = hq // hk
    block_g = max(16, triton.next_power_of_2(g))
    block_d, block_n, stages = _decode_blocks(d, None if invariant else b, tuning,
                                              tiles.is_fp8(k_cache))
    m = block_tables.shape[1]
    if num_splits is None:
        num_splits = _decode_num_splits(split_rows or b, hk, m, bs, block_n, q.device, tuning)
        if min_tiles is None:
            min_tiles = _decode_min_tiles(split_rows or b, hk, q.device, tuning)
    num_splits = max(1, int(num_splits))
    min_tiles = max(1, int(tuning.min_tiles_per_split if min_tiles is None else min_tiles))
    direct = num_splits == 1
    ieee = ieee_dot(q.dtype, k_cache.dtype)
    if direct:
        po = pm = pl = counters = out  # unused
    else:
        po = tiles._new((b, hq, num_splits, block_d), torch.float32, q.device)
        pm = tiles._new((b, hq, num_splits), torch.float32, q.device)
        pl = tiles._new((b, hq, num_splits), torch.float32, q.device)
        counters = ticket_counters(q.device, b * hk)
    block_gr = triton.next_power_of_2(g)
    merge_splits = max(1, min(triton.next_power_of_2(num_splits),
                              tuning.merge_elements // (block_gr * block_d)))
    dependent = pdl.enabled(q)
    # fewer warps for small head dims, but not for large batches (batch-invariant: always, the
    # launch may not depend on the batch)
    rows = None if invariant else b
    small = block_d <= tuning.small_head_dim and (rows is None or rows < tuning.four_warps_min_rows)
    num_warps = tuning.decode_small_head_warps if small else tuning.decode_warps
    _decode_split_kernel[(b, hk, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, po, pm, pl, counters,
        kn, vn, pos, slots, cos, sin,
        float(scale) * LOG2E, g, d, num_splits, min_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *rope_strides,
        BLOCK_SIZE=bs, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_GR=block_gr,
        MERGE_SPLITS=merge_splits, DIRECT=direct, IEEE=ieee,
        ROPE=rope is not None, PDL=dependent,
        PREFETCH=rope is not None and bool(
            b <= tuning.prefetch_max_rows if prefetch is None else prefetch),
        num_warps=num_warps, num_stages=stages, launch_pdl=dependent)
    return out
