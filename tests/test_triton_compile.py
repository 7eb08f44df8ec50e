"""Every Triton kernel compiles for an H100 (sm_90), on a machine without a GPU.

CI has no GPU and the interpreter runs kernels as numpy, so a kernel that the interpreter accepts
may still fail to compile, or compile to slow code, on the device. Here Triton is given a stand-in
driver that reports an sm_90 target, and each launch is turned into a compile-only warm-up: the
wrappers run as the model calls them (same argument types, alignments and divisibility
specialisations), every kernel goes through the whole NVIDIA pipeline down to ptxas, nothing
runs. The projections are also checked to stream their weights with vector or async copies:
scalar 2-byte loads would cut their bandwidth several times over (a `do_not_specialize` on the
split length did exactly that once, invisible to every other test).
"""
from __future__ import annotations

import os
import re

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU runs the kernels instead"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") == "1",
                       reason="compiles real kernels, not the interpreter's"),
]
triton = pytest.importorskip("triton")


class _Sm90:
    """Just enough of a Triton driver to compile for an H100."""

    def is_active(self):
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def compiled(monkeypatch):
    """Routes every kernel launch to a compile for sm_90; yields the list of
    (kernel name, compiled kernel) it fills."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from graphexec.kernels import attention_decode_triton, linear_fused_triton, linear_triton

    out: list = []
    touched: set = set()
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        touched.add(self)
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        out.append((self.fn.__name__, kernel))
        return kernel

    monkeypatch.setattr(driver, "_active", _Sm90())  # restored (to none) after the test
    monkeypatch.setattr(JITFunction, "run", compile_only)
    monkeypatch.setattr(attention_decode_triton, "_sm_count", lambda device: 132)
    # The wrappers send CPU tensors to torch; let them take the kernel path anyway.
    monkeypatch.setattr(linear_triton, "_INTERPRET", False)
    orig_supported = linear_triton.supported
    supported = lambda x, *a, **k: orig_supported(  # noqa: E731
        x, *a, **k) or _would_support(orig_supported, x, *a, **k)
    monkeypatch.setattr(linear_triton, "supported", supported)
    # linear_fused_triton holds its own name for it, bound when some earlier test imported it
    monkeypatch.setattr(linear_fused_triton, "supported", supported)
    try:
        yield out
    finally:
        for fn in touched:  # compiled for a target this machine does not have
            fn.device_caches.clear()


def _would_support(check, x, *args, **kwargs) -> bool:
    """supported() with the device test passed (CPU tensors stand in for CUDA ones)."""
    from graphexec.kernels import linear_triton
    linear_triton._INTERPRET = True
    try:
        return check(x, *args, **kwargs)
    finally:
        linear_triton._INTERPRET = False


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def _weight_loads(kernel) -> tuple[int, int]:
    """(vector or async global loads, scalar 16-bit global loads) in the PTX."""
    ptx = kernel.asm["ptx"]
    fast = len(re.findall(r"cp\.async|ld\.global(?:\.\w+)*\.v[248]", ptx))
    scalar = len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx))
    return fast, scalar


def test_projection_kernels_compile_and_stream_weights(compiled):
    from graphexec.kernels import linear_fused_triton as lf
    from graphexec.kernels import linear_invariant_triton as li
    from graphexec.kernels import linear_triton as lt

    h, qkv, inter = 2048, 3072, 8192  # llama-1b
    for m in (1, 5, 16, 64):
        x, res = _bf16(m, h), _bf16(m, h)
        nw = _bf16(h)
        lt.linear(x, _bf16(h, h))
        lt.norm_linear(x, res, nw, 1e-5, _bf16(qkv, h), _bf16(qkv))
        lt.silu_mul_linear(_bf16(m, 2 * inter), _bf16(h, inter))
        li.linear_invariant(x, _bf16(qkv, h))
    # the norm split between two projections (Prenormed), the split-K sum's share too
    for split in (1, 4):
        cfg = lt.LinearConfig(64, 64, 128, split)
        p = lf.linear_add(_bf16(64, inter), _bf16(h, inter), _bf16(64, h), cfg, next_norm=_bf16(h))
        lf.prenormed_linear(p, 1e-5, _bf16(qkv, h))
        lf.prenormed_linear(p, 1e-5, _bf16(2 * inter, h), silu_out=True)
    # the L2 warm-up of the next projection's weight: the hint is in the code, a line a lane
    lt.linear(_bf16(64, h), _bf16(qkv, h), config=lt.LinearConfig(64, 32, 128),
              prefetch=_bf16(h, h), prefetch_bytes=2 << 20)
    li.norm_linear_invariant(_bf16(80, h), _bf16(80, h), _bf16(h), 1e-5, _bf16(h, h))
    names = {name for name, _ in compiled}
    assert {"_linear_kernel", "_linear_add_kernel", "_split_sum_kernel"} <= names, names
    prefetching = 0
    for name, kernel in compiled:
        if name.startswith("_linear"):  # the plain, residual and send epilogues alike
            fast, scalar = _weight_loads(kernel)
            consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
            # A bias of BLOCK_N = 2 elements may load as scalars; weights as scalars would be
            # BLOCK_N * BLOCK_K / threads loads per thread (dozens).
            assert fast > 0 and scalar <= 2, (sorted(consts.items()), fast, scalar)
            hints = kernel.asm["ptx"].count("prefetch.global.L2::evict_last")
            assert (hints > 0) == (consts["PF_LINES"] > 0), (consts["PF_LINES"], hints)
            prefetching += consts["PF_LINES"] > 0
    assert prefetching == 1


def _before_wait(ptx: str) -> str:
    assert ptx.count("griddepcontrol.wait") == 1, "one wait"
    assert "griddepcontrol.launch_dependents" in ptx
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert not re.search(r"\bst\.global|cp\.async\.bulk|\bred\.|\batom\.", before)
    return before


def test_projections_with_programmatic_dependent_launch(compiled, monkeypatch):
    """On sm_90 the projections launch as programmatic dependents (kernels/pdl.py): each must
    fetch only weights before griddepcontrol.wait (anything an earlier kernel wrote, or a
    store, before the wait would race with it), and it signals its own dependents."""
    from graphexec.kernels import linear_triton as lt
    from graphexec.kernels import pdl

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    h, qkv, inter = 2048, 3072, 8192
    for m in (1, 16):
        x, res = _bf16(m, h), _bf16(m, h)
        lt.linear(x, _bf16(qkv, h), _bf16(qkv))
        # one row: the shipped fused config (pick_norm_config); more: a forced fused one
        cfg = None if m == 1 else lt.pick_config(m, qkv, h)
        lt.norm_linear(x, res, _bf16(h), 1e-5, _bf16(qkv, h), config=cfg)
        lt.silu_mul_linear(_bf16(m, 2 * inter), _bf16(h, inter),
                           config=None if m == 1 else lt.pick_config(m, h, inter))
    kernels = [k for name, k in compiled if name == "_linear_kernel"]
    assert len(kernels) == 6
    for kernel in kernels:
        assert kernel.metadata.launch_pdl
        before = _before_wait(kernel.asm["ptx"])
        # Before the wait: exactly the first weight tile, in 16-byte loads (8 bf16 per load,
        # 32 threads per warp); x, the residual and the norm weight come after it.
        consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
        loads_before = re.findall(r"ld\.global(?:\.\w+)*\.v4|cp\.async", before)
        tile_loads = consts["BLOCK_N"] * consts["BLOCK_K"] // (kernel.metadata.num_warps * 32 * 8)
        assert len(loads_before) == tile_loads, (sorted(consts.items()), len(loads_before))
        assert not re.search(r"ld\.global(?!(?:\.\w+)*\.v4)", before)


def test_other_kernels_wait_first_with_programmatic_dependent_launch(compiled, monkeypatch):
    """GRAPHEXEC_PDL=all: RMSNorm, rope + KV write, decode attention, silu * mul and the tail
    kernels (stop-token mask, sampling, argmax, advance) launch as dependents and wait before
    any global store, and before any load but the fused attention's
    prefetch (kernels/attention_decode_triton.py, PREFETCH)."""
    from graphexec.kernels import pdl
    from graphexec.kernels.activation_triton import silu_mul
    from graphexec.kernels.norm_rope_triton import add_rms_norm
    from graphexec.kernels.triton_ops import TRITON_OPS as ops
    from graphexec.kernels.attention_decode_triton import decode_attention_splits

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    t, hq, hk, d, bs, nb = 4, 32, 8, 128, 16, 64
    ops.rms_norm(_bf16(t, 2048), _bf16(2048), 1e-5)
    add_rms_norm(_bf16(t, 2048), _bf16(t, 2048), _bf16(2048), 1e-5)
    q, k, v = _bf16(t, hq, d), _bf16(t, hk, d), _bf16(t, hk, d)
    cos, sin = torch.randn(64, d // 2), torch.randn(64, d // 2)
    kc, vc = _bf16(nb, bs, hk, d), _bf16(nb, bs, hk, d)
    ops.rope_write_kv(q, k, v, torch.arange(t), cos, sin, kc, vc, torch.arange(t))
    silu_mul(_bf16(t, 2 * 8192))
    tables = torch.arange(t * 8, dtype=torch.int32).view(t, 8)
    decode_attention_splits(q, kc, vc, tables, torch.full((t,), 100, dtype=torch.int32),
                            d ** -0.5, 4)
    decode_attention_splits(q, kc, vc, tables, torch.full((t,), 100, dtype=torch.int32),
                            d ** -0.5, 4, rope=(k, v, torch.arange(t), cos, sin,
                                                torch.arange(t)))
    # the step's tail after the LM head
    logits = _bf16(t, 128256)
    ops.mask_stop_tokens(logits, torch.zeros(t, 2, dtype=torch.int64), torch.arange(t),
                         torch.full((t,), 2), inplace=True)
    ops.sample(logits, torch.rand(t), torch.full((t,), 50), torch.full((t,), 0.9),
               torch.arange(t), torch.arange(t))
    ops.argmax(logits)
    ops.advance(torch.arange(t), torch.arange(t), torch.arange(t), torch.arange(t),
                torch.tensor([t]), torch.zeros(t, 2, dtype=torch.int64)[:, 0])
    packed = torch.zeros(t, 6, dtype=torch.int64)  # the speculative step's tail
    ops.spec_advance(torch.zeros(t, 5, dtype=torch.int64), None,
                     torch.zeros(t, 4, dtype=torch.int64), torch.arange(t), torch.arange(t),
                     torch.arange(t), torch.tensor([t]), packed[:, :5], packed[:, 5])
    names = {name for name, _ in compiled}
    expected = {"_rms_norm_kernel", "_rope_write_kv_kernel", "_silu_mul_kernel",
                "_decode_split_kernel", "_mask_stop_kernel",
                "_chunk_kernel", "_select_kernel", "_argmax_chunk_kernel",
                "_argmax_reduce_kernel", "_advance_kernel", "_spec_advance_kernel"}
    assert expected <= names, expected - names
    prefetching = 0
    for name, kernel in compiled:
        if name in expected:
            assert kernel.metadata.launch_pdl, name
            before = _before_wait(kernel.asm["ptx"])  # no store or atomic in any of them
            consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
            if consts.get("PREFETCH"):
                # the fused rope + attention reads the row's metadata and its first KV tile
                # (written before the forward began) ahead of the wait
                prefetching += 1
                assert re.search(r"ld\.global", before), "the prefetch no longer precedes the wait"
            else:
                assert not re.search(r"ld\.global|cp\.async", before), name
    assert prefetching == 1


def test_fused_decode_attention_publishes_the_new_token_before_reading(compiled):
    """rope_decode_attention: the program that owns a row's new token stores its K/V and then
    reads the cache in its loop. A CTA barrier between the two makes the stores visible to every
    thread of the program (generic-proxy loads: plain or cp.async); a TMA load (cp.async.bulk)
    would also need a proxy fence, so none may appear. If Triton stops streaming the loop with
    cp.async this test fails and the check must be rewritten for the new loads."""
    from graphexec.kernels import rope
    from graphexec.kernels.attention_decode_triton import decode_attention_splits

    t, hq, hk, d, bs, nb = 4, 32, 8, 128, 16, 64
    qkv = _bf16(t, (hq + 2 * hk) * d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    cos, sin = rope.rope_cos_sin(4096, d, 500000.0)
    tables = torch.arange(t * 8, dtype=torch.int32).view(t, 8)
    for splits in (1, 4):
        decode_attention_splits(q, _bf16(nb, bs, hk, d), _bf16(nb, bs, hk, d), tables,
                                torch.full((t,), 100, dtype=torch.int32), d ** -0.5, splits,
                                rope=(k, v, torch.arange(t), cos, sin, torch.arange(t)))
    kernels = [kern for name, kern in compiled if name == "_decode_split_kernel"]
    assert len(kernels) == 2
    for kernel in kernels:
        ptx = kernel.asm["ptx"]
        assert "cp.async.bulk" not in ptx
        first_store = ptx.index("st.global")
        barrier = re.compile(r"bar\.sync|barrier\.sync").search(ptx, first_store)
        assert barrier is not None, "no barrier after the new token's stores"
        # the KV loop streams tiles with cp.async; the plain loads before the barrier are the
        # row's inputs (q, cos, sin, the new v), which no program of this kernel writes
        assert "cp.async" not in ptx[:barrier.start()], "a KV tile load before the barrier"
        assert "cp.async" in ptx[barrier.end():], "the KV loop no longer uses cp.async"


def test_model_kernels_compile(compiled, monkeypatch):
    from graphexec.kernels import activation_triton, norm_rope_triton, rope, write_kv_triton
    from graphexec.kernels.triton_ops import TRITON_OPS as ops
    from graphexec.kernels.attention_decode_triton import (decode_attention_invariant,
                                                            decode_attention_splits)
    from graphexec.kernels.attention_prefill_triton import prefill_attention_invariant

    t, hq, hk, d, bs, nb = 6, 32, 8, 128, 16, 64
    x = _bf16(t, 2048)
    ops.rms_norm(x, _bf16(2048), 1e-5)
    norm_rope_triton.add_rms_norm(x, _bf16(t, 2048), _bf16(2048), 1e-5)
    ops.rms_norm(_bf16(t, hq, d), _bf16(d), 1e-5)  # qk-norm rows
    qkv = _bf16(t, (hq + 2 * hk) * d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    pos = torch.arange(t)
    cos, sin = rope.rope_cos_sin(4096, d, 500000.0)
    kc, vc = _bf16(nb, bs, hk, d), _bf16(nb, bs, hk, d)
    slots = torch.arange(t)
    ops.rope_write_kv(q, k, v, pos, cos, sin, kc, vc, slots)
    norm_rope_triton.apply_rope(q, k, pos, cos, sin)
    write_kv_triton.write_kv(kc, vc, k, v, slots)
    activation_triton.silu_mul(_bf16(t, 2 * 8192))
    tables = torch.arange(t * 8, dtype=torch.int32).view(t, 8)
    lens = torch.full((t,), 100, dtype=torch.int32)
    qd = _bf16(t, hq, d)
    ops.decode_attention(qd, kc, vc, tables, lens, d ** -0.5)
    ops.rope_decode_attention(q, k, v, pos, cos, sin, kc, vc, slots, tables, lens, d ** -0.5)
    decode_attention_splits(q, kc, vc, tables, lens, d ** -0.5, 1,
                            rope=(k, v, pos, cos, sin, slots))
    decode_attention_splits(qd, kc, vc, tables, lens, d ** -0.5, 1)
    decode_attention_invariant(qd, kc, vc, tables, lens, d ** -0.5)
    cu = torch.tensor([0, 2, t], dtype=torch.int32)
    ops.prefill_attention(qd, kc, vc, cu, torch.tensor([50, 4], dtype=torch.int32),
                          tables[:2], d ** -0.5)
    prefill_attention_invariant(qd, kc, vc, cu, torch.tensor([50, 4], dtype=torch.int32),
                                tables[:2], d ** -0.5)
    b, vocab = 4, 128256
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the logits the model returns
        ops.sample(torch.randn(b, vocab).to(dtype), torch.tensor([0.0, 0.7, 1.0, 0.9]),
                   torch.tensor([0, 50, 0, 5]), torch.tensor([1.0, 0.9, 0.8, 1.0]),
                   torch.arange(b), torch.arange(b))
    ops.argmax(torch.randn(b, vocab).to(dtype))
    ops.decode_metadata(torch.arange(b), tables[:b], bs)
    ops.advance(torch.arange(b), torch.arange(b), torch.arange(b), torch.arange(b),
                torch.tensor([b]))
    names = {name for name, _ in compiled}
    expected = {"_rms_norm_kernel", "_rope_write_kv_kernel", "_rope_kernel", "_write_kv_kernel",
                "_silu_mul_kernel", "_decode_split_kernel",
                "_prefill_kernel", "_chunk_kernel", "_select_kernel", "_advance_kernel",
                "_argmax_chunk_kernel", "_argmax_reduce_kernel"}
    assert expected <= names, expected - names
    for name, kernel in compiled:  # bf16 tensors are read with vector or async loads; a
        # broadcast vector (a norm weight spread one element per thread) may load as scalars,
        # and so may the fused decode attention's new token (one head of k in two halves and
        # of v: 3 scalar loads of a few hundred bytes per row, next to the KV stream)
        consts = {kernel.src.fn.arg_names[i[0]]: v for i, v in kernel.src.constants.items()}
        allowed = 2 + (3 if consts.get("ROPE") else 0)
        assert _weight_loads(kernel)[1] <= allowed, (name, _weight_loads(kernel))


def test_all_reduce_kernel_compiles_to_wide_pushes_and_volatile_polls(compiled, monkeypatch):
    """kernels/all_reduce_triton.py for sm_90, at two and three ranks: each peer gets the
    program's share in 16-byte stores of two whole 8-byte words (a word must never tear;
    boxes are 16-byte aligned at any rank count), the only other stores are the zeroing of
    the own box (both halves the same zero) and the result; the polls are volatile 16-byte
    loads; the deadline and trap are there; nothing is read or written before the PDL wait,
    and no atomic or fence waits on the link."""
    from graphexec.kernels import all_reduce_triton as ar
    from graphexec.kernels import pdl
    from graphexec.kernels.tuning import DEFAULT

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    t = DEFAULT.collective
    words_per_thread = t.all_reduce_block // (32 * t.all_reduce_warps)
    box = ar.PeerAreas.box_words(3 << 20)  # an area's boxes as symmetric.py sizes them
    ar.all_reduce(torch.zeros(1, 4096, dtype=torch.float32),
                  ar.PeerAreas(0, 2, torch.zeros(2, dtype=torch.int64), box), 1)
    (name, _), = compiled  # fp32 messages too: one element a word
    for world, rank in ((2, 0), (3, 2)):
        compiled.clear()
        ar.all_reduce(_bf16(1, 4096),
                      ar.PeerAreas(rank, world, torch.zeros(world, dtype=torch.int64), box), 0)
        (name, kernel), = compiled
        assert name == "_all_reduce_kernel" and kernel.metadata.launch_pdl
        ptx = kernel.asm["ptx"]
        assert not re.search(r"\b(ld|st)\.global", _before_wait(ptx)), "memory before PDL wait"
        stores = re.findall(r"\bst\.global(\.v\d)?\.b(\d+)\s+\[[^\]]+\],\s*\{?([^;}]*)", ptx)
        halves = lambda ops: {o.strip() for o in ops.split(",")}
        pushes = [ops for vec, bits, ops in stores
                  if (vec, bits) == (".v2", "64") and len(halves(ops)) == 2]
        zeroing = [ops for vec, bits, ops in stores
                   if (vec, bits) == (".v2", "64") and len(halves(ops)) == 1]
        results = [ops for vec, bits, ops in stores if (vec, bits) == (".v4", "32")]
        assert len(pushes) == words_per_thread // 2 * (world - 1), (world, stores)
        assert zeroing and results and len(pushes + zeroing + results) == len(stores), stores
        assert re.search(r"ld\.volatile\.global\.v2\.b64", ptx), "polls that re-read memory"
        assert not re.search(r"\b(atom|red|membar|fence)\.", ptx), "a round trip on the link"
        assert "%globaltimer" in ptx and re.search(r"\btrap;", ptx), "the deadline and its trap"


def test_projections_push_whole_words_and_the_all_reduce_then_sends_none(compiled,
                                                                         monkeypatch):
    """o and down of a llama-8b rank at 64 rows, pushing their partial sums (all_reduce_triton
    .Push): the kernel that writes the output (the projection, or down's split-K sum) stores
    each word to the peer whole, two to a 16-byte store; the all-reduce told the words were
    pushed stores none to a peer, only its zeroing and its result."""
    from graphexec.kernels import all_reduce_triton as ar
    from graphexec.kernels import linear_fused_triton as lf
    from graphexec.kernels import pdl

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    areas = ar.PeerAreas(0, 2, torch.zeros(2, dtype=torch.int64),
                         ar.PeerAreas.box_words(4 << 20))
    lf.linear_partial(_bf16(64, 2048), _bf16(4096, 2048), push=ar.Push(areas, 0))
    lf.linear_partial(_bf16(64, 7168), _bf16(4096, 7168), push=ar.Push(areas, 1))
    names = [name for name, _ in compiled]
    # split K: the plain kernel writes the partials, the split-K sum pushes
    assert names == ["_linear_send_kernel", "_linear_kernel", "_split_sum_kernel"], names
    for i in (0, 2):  # the kernels that hold the finished sums
        ptx = compiled[i][1].asm["ptx"]
        assert re.search(r"\bst\.global\.v2\.b64", ptx), names[i]
        assert not re.search(r"\bst\.global\.b64", ptx), f"{names[i]}: an 8-byte word alone"
    assert not re.search(r"\bst\.global(\.v\d)?\.b64", compiled[1][1].asm["ptx"]), \
        "split K: the partials are not the message"
    compiled.clear()
    ar.all_reduce_add_rms_norm(_bf16(64, 4096), _bf16(64, 4096), _bf16(4096), 1e-5, areas, 0,
                               pushed=True)
    (name, kernel), = compiled
    stores = re.findall(r"\bst\.global(\.v\d)?\.b(\d+)\s+\[[^\]]+\],\s*\{?([^;}]*)",
                        kernel.asm["ptx"])
    words = [ops for vec, bits, ops in stores if bits == "64"]
    assert words and all(len({o.strip() for o in ops.split(",")}) == 1 for ops in words), \
        "a push besides the zeroing"


def test_the_lm_head_lands_its_tiles_and_releases_one_arrival_a_program(compiled,
                                                                        monkeypatch):
    """A llama-8b rank's LM head at 64 rows landing its logits (kernels/gather_triton.py): the
    tiles go to the peer in vector stores, then one `red.release.sys` a peer after a barrier
    (no atom, whose answer would cross back); the wait polls with `ld.acquire.sys`, has its
    deadline and trap, and reads nothing before its PDL wait."""
    from graphexec.kernels import gather_triton as gt
    from graphexec.kernels import linear_fused_triton as lf
    from graphexec.kernels import pdl

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    ptrs = torch.zeros(2, dtype=torch.int64)
    landing = gt.Landing(1, 2, ptrs, ptrs, torch.zeros(2 << 24, dtype=torch.uint8),
                         torch.zeros(1, dtype=torch.int64), 16 << 20)
    lf.linear_gathered(_bf16(64, 4096), _bf16(64128, 4096), landing)
    names = [name for name, _ in compiled]
    assert names == ["_linear_send_kernel", "_wait_kernel"], names
    head, wait = (kernel.asm["ptx"] for _, kernel in compiled)
    # the local columns and the peer's box alike: 16-byte stores, no 2-byte ones
    assert len(re.findall(r"\bst\.global\.v4\.b32", head)) >= 2, "tiles in 16-byte stores"
    assert not re.search(r"\bst\.global(\.\w+)*\.b16\b", head), "2-byte stores"
    assert len(re.findall(r"red\.release\.sys\.global\.add\.u64", head)) == 1
    assert not re.search(r"\batom\.", head)
    # the tile's last store, then a barrier, then the release (the split-K branch's stores
    # come later in the text, on the other path)
    release = head.index("red.release.sys")
    last_store = max(m.start() for m in re.finditer(r"\bst\.global", head[:release]))
    assert "bar.sync" in head[last_store:release], \
        "the release must follow a barrier after every thread's stores"
    assert re.search(r"ld\.acquire\.sys\.global\.u64", wait)
    assert "%globaltimer" in wait and re.search(r"\btrap;", wait)
    assert not re.search(r"\b(ld|st)\.global", _before_wait(wait)), "memory before PDL wait"


def test_penalty_kernels_compile_and_wait_first(compiled, monkeypatch):
    """The penalties' and grammar masks' kernels (kernels/penalties_triton.py,
    token_mask_triton.py) compile for sm_90 and, launched as
    programmatic dependents, read nothing before the wait: the logits and counts they touch
    come from the kernels before them."""
    from graphexec.kernels import pdl, penalties_triton as pt

    monkeypatch.setattr(pdl, "enabled", lambda x, *args, **kwargs: True)
    t, v, s = 4, 128256, 9
    logits, slots = _bf16(t, v), torch.arange(t)
    pt.apply_logit_bias(logits, slots, torch.zeros(s, 300, dtype=torch.int32),
                        torch.zeros(s, 300))
    seen = (torch.zeros(s, v, dtype=torch.int32), torch.zeros(s, v, dtype=torch.uint8),
            torch.zeros(s, v, dtype=torch.int32), torch.zeros(s, dtype=torch.int32))
    pt.apply_penalties(logits, slots, *seen, torch.zeros(s), torch.zeros(s), torch.ones(s))
    pt.apply_min_p(logits, slots, torch.rand(t), torch.zeros(s))
    pt.count_tokens(*seen, slots, torch.arange(t), torch.ones(t, dtype=torch.bool))
    from graphexec.kernels.token_mask_triton import apply_token_mask
    rows = torch.zeros(t, v // 64 + 1, dtype=torch.int64)  # DecodeState.grammar_rows' layout
    apply_token_mask(logits, rows[:, :-1].view(torch.int32), rows[:, -1])
    want = {"_bias_kernel", "_penalty_kernel", "_min_p_kernel", "_count_kernel",
            "_token_mask_kernel"}
    kernels = [(name, k) for name, k in compiled if name in want]
    assert {name for name, _ in kernels} == want
    for name, kernel in kernels:
        assert kernel.metadata.launch_pdl, name
        assert not re.search(r"ld\.global|st\.global", _before_wait(kernel.asm["ptx"])), name
    # penalties round count * frequency before subtracting it, as the reference does
    penalty = next(k for name, k in kernels if name == "_penalty_kernel")
    assert "mul.rn.f32" in penalty.asm["ptx"] and "fma" not in penalty.asm["ptx"]


def test_mask_gate_polls_the_host_flag_with_a_deadline(compiled):
    """kernels/mask_gate_triton.py for sm_90: one warp polls the flag with volatile loads (each
    poll re-reads host memory), the flags and mask words are read volatile too (after the
    flag, never from a cache), and the wait has its deadline and trap."""
    from graphexec.kernels.mask_gate_triton import await_masks

    rows = torch.zeros(65, 128256 // 64 + 1, dtype=torch.int64)
    one = lambda: torch.zeros(1, dtype=torch.int64)  # noqa: E731
    await_masks(one(), one(), one(), torch.zeros(65, 128256 // 32, dtype=torch.int32),
                torch.zeros(65, dtype=torch.int64), rows)
    (wait_name, wait), (copy_name, copy) = compiled
    assert (wait_name, copy_name) == ("_await_flag_kernel", "_copy_masks_kernel")
    ptx = wait.asm["ptx"]
    assert len(re.findall(r"ld\.volatile\.global", ptx)) >= 2, "polls and flags from the bus"
    assert "%globaltimer" in ptx and re.search(r"\btrap;", ptx), "the deadline and its trap"
    assert wait.metadata.num_warps == 1, "one warp polls"
    assert "ld.volatile.global" in copy.asm["ptx"], "mask words from the bus"
