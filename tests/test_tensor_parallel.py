"""Tensor parallelism on the CPU: 2 ranks over gloo, fp32. Size 1 is the oracle for size 2: the
same weights split over two processes must give the same tokens, and logits equal up to the
order fp32 sums in. Each size-2 engine starts a process that imports torch (seconds here), so
the cases are few and the runs short."""
import multiprocessing
import os
import signal
import time

import pytest
import torch

from gguf_helpers import hf_tensors, write_gguf
from graphexec import Engine, SamplingParams, SpeculativeConfig, TensorParallelError
from graphexec.config import EngineConfig
from graphexec.model import load_model, preset, random_weights, resolve_model
from graphexec.model.shard import Shard
from lifecycle_helpers import check_blocks, collect, drain
from tp_helpers import PROMPTS, on_every_rank, sharded_logits

G = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(max_batch=4, num_kv_blocks=40, block_size=8, max_model_len=256, seed=3)
CPU = torch.device("cpu")


def run(size: int, program, model: str = "tiny", **kw) -> tuple[dict, dict]:
    """program(engine, step) drives an engine at tensor_parallel_size=size to the end; returns
    the final output of each request and the engine's stats."""
    with Engine(model, tensor_parallel_size=size, **{**ENGINE, **kw}) as engine:
        out: dict = {}

        def step(n: int = 1) -> None:
            for _ in range(n):
                collect(engine.step(), out)
                check_blocks(engine)

        program(engine, step)
        drain(engine, out)
        return out, engine.stats_summary()


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), rid
        assert (g.num_drafted_tokens, g.num_accepted_tokens) == \
            (w.num_drafted_tokens, w.num_accepted_tokens), rid
        assert (g.logprobs is None) == (w.logprobs is None), rid
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
            assert a.logprob == pytest.approx(b.logprob, rel=1e-4, abs=1e-4)


def mixed_requests(engine, step) -> None:
    """Greedy and seeded sampled rows (top-k, top-p), logprobs on some, arriving over steps."""
    params = [SamplingParams(max_tokens=10, **G),
              SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=11, logprobs=3,
                             ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, logprobs=2, **G)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [7 + 13 * i, 3, 250 - i, 40] * (i + 1), p)
        step(i % 2)


# -- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_size_must_be_a_positive_integer(size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Engine("tiny", tensor_parallel_size=size)


@pytest.mark.parametrize("size,field", [(3, "num_heads=4"), (4, "num_kv_heads=2")])
def test_size_that_does_not_divide_the_heads(size, field):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size} does not divide {field}"):
        Engine("tiny", tensor_parallel_size=size)
    assert multiprocessing.active_children() == []  # refused before any worker started


def test_size_that_does_not_divide_the_mlp():
    with pytest.raises(ValueError, match="does not divide intermediate_size=255"):
        Shard(0, 2).check(preset("tiny", intermediate_size=255), "tiny")


def test_size_above_the_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 CUDA devices"):
        EngineConfig(model="tiny", device="cuda", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices"):
        EngineConfig(model="tiny", device="cuda:1", tensor_parallel_size=2)
    assert EngineConfig(model="tiny", device="cuda", tensor_parallel_size=2).device.index is None


def test_llama_70b_preset_splits_over_8():
    mc = preset("llama-70b")
    assert (mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.intermediate_size,
            mc.vocab_size, mc.rope_theta) == (80, 8192, 64, 8, 28672, 128256, 500000.0)
    assert 69e9 < mc.num_parameters() < 72e9
    for size in (2, 4, 8):
        Shard(0, size).check(mc, "llama-70b")
    part = Shard(7, 8).config(mc)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (8, 1, 3584)


def test_the_triton_reducer_refuses_a_slot_twice_in_a_row():
    """The kernel's race freedom rests on consecutive all-reduces alternating their slots
    (kernels/all_reduce_triton.py): the reducer checks it on the host, so a caller that broke
    it fails at once instead of hanging the GPUs. (The kernel itself is stubbed: no GPU.)"""
    from types import SimpleNamespace

    from graphexec.parallel.symmetric import TritonAllReduce

    calls = []
    reducer = object.__new__(TritonAllReduce)
    reducer._kernel = SimpleNamespace(
        all_reduce=lambda x, areas, slot, pushed, t: calls.append(slot) or x)
    reducer.areas, reducer._last_slot, reducer.t = None, None, None
    t = torch.zeros(4)
    for slot in (0, 1, 0, 1):
        assert reducer(t, slot) is t
    with pytest.raises(RuntimeError, match="slot 1 twice in a row"):
        reducer(t, 1)
    assert calls == [0, 1, 0, 1]


def test_presets_count_the_published_parameters_and_stream_all_but_an_untied_embedding():
    """The counts the bench's rooflines rest on: the published totals of Llama 3.1 8B / 70B and
    Llama 3.2 1B (their model cards), and per step every weight but an untied embedding table,
    whose rows a step reads one per token (a tied one is the LM head, read whole)."""
    published = {"llama-8b": 8_030_261_248, "llama-70b": 70_553_706_496,
                 "llama-1b": 1_235_814_400}
    for name, total in published.items():
        mc = preset(name)
        assert mc.num_parameters() == total, name
        embed = 0 if mc.tie_word_embeddings else 128256 * mc.hidden_size
        assert mc.streamed_parameters() == total - embed, name
    assert preset("llama-1b").tie_word_embeddings and not preset("llama-8b").tie_word_embeddings


# -- weights ----------------------------------------------------------------------------------


def _halves_rebuild_the_whole(whole, halves, mc) -> None:
    """Each rank's stacked qkv / gate_up holds its slice of each part; o and down split by
    input columns; the rest replicated."""
    q, kv, inter = mc.q_size, mc.kv_size, mc.intermediate_size
    for i, layer in enumerate(whole.layers):
        parts = [h.layers[i] for h in halves]
        for name, sizes in (("qkv", (q, kv, kv)), ("gate_up", (inter, inter)),
                            ("qkv_bias", (q, kv, kv))):
            full = getattr(layer, name)
            if full is None:
                continue
            pieces = [getattr(p, name).split([s // 2 for s in sizes]) for p in parts]
            for j, piece in enumerate(full.split(list(sizes))):
                assert torch.equal(piece, torch.cat([pieces[0][j], pieces[1][j]])), name
        for name in ("o", "down"):
            assert torch.equal(getattr(layer, name),
                               torch.cat([getattr(p, name) for p in parts], dim=1)), name
        assert all(torch.equal(p.input_norm, layer.input_norm) for p in parts)
    assert all(torch.equal(h.lm_head, whole.lm_head) for h in halves)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, hf_dirs):
    _, hf = hf_dirs["llama"]
    path = str(tmp_path_factory.mktemp("tp-gguf") / "llama.gguf")
    write_gguf(path, "llama", hf.config, hf_tensors(hf, "llama"))
    return path


def test_each_loader_hands_a_rank_its_slices(hf_dirs, llama_gguf):
    for model in (hf_dirs["qwen2"][0], llama_gguf):  # safetensors with qkv bias; GGUF
        source = resolve_model(model)
        mc, whole = load_model(source, CPU, torch.float32)
        halves = [load_model(source, CPU, torch.float32, shard=Shard(r, 2))[1] for r in (0, 1)]
        _halves_rebuild_the_whole(whole, halves, mc)
    mc = preset("tiny")  # random weights: drawn whole, so the model is the same at every size
    halves = [random_weights(mc, CPU, torch.float32, seed=4, shard=Shard(r, 2)) for r in (0, 1)]
    _halves_rebuild_the_whole(random_weights(mc, CPU, torch.float32, seed=4), halves, mc)


def test_sharded_forward_logits_equal_unsharded(hf_dirs, llama_gguf):
    """The forward over 2 ranks (o and down all-reduced) against one process with the whole
    weights: a preset, an HF checkpoint with qkv bias, one with q/k norms, and a GGUF file."""
    from test_hf_parity import _graphexec_prefill_logits

    models = ["tiny", hf_dirs["qwen2"][0], hf_dirs["qwen3"][0], llama_gguf]
    ranks = sharded_logits(models, 2)
    for i, model in enumerate(models):
        whole = torch.cat(_graphexec_prefill_logits(model, "cpu", torch.float32,
                                                    PROMPTS))
        rank0, rank1 = ranks[0][i], ranks[1][i]
        assert torch.equal(rank0, rank1), model  # sampling sees the same logits everywhere
        rel = ((rank0 - whole).norm() / whole.norm()).item()
        assert rel < 1e-5, f"{model}: relative error {rel:.2e}"
        assert torch.equal(rank0.argmax(-1), whole.argmax(-1)), model


def test_an_all_reduce_that_adds_and_norms_gives_the_same_logits():
    """A reducer whose all-reduce also does the next residual add and norm (the Triton one's
    fused kernel, here over gloo and the reference norm): every reduction but the last layer's
    takes it, and the logits are those of the plain all-reduce and separate norms, bit for bit
    (the same operations in the same order). An op set that refuses it (a batch-invariant one)
    never gets it."""
    from tp_helpers import _logits_through_the_norming_reducer

    models = ["tiny"]
    plain = sharded_logits(models, 2)
    fused = on_every_rank(_logits_through_the_norming_reducer, (models,), 2,
                          torch.device("cpu"))
    layers = preset("tiny").num_layers
    for rank, (arrays, calls, refused) in enumerate(fused):
        assert calls == {"fused": 2 * layers - 1, "plain": 1}, calls
        assert torch.equal(torch.from_numpy(arrays[0]), plain[rank][0])
        assert refused == {"fused": 0, "plain": 2 * layers}, refused
    from graphexec.kernels.triton_ops import op_set
    from graphexec.kernels.tuning import DEFAULT

    assert op_set("auto", False, DEFAULT).all_reduce_norm
    assert not op_set("auto", True, DEFAULT).all_reduce_norm


# -- engines ----------------------------------------------------------------------------------


def test_async_and_sync_at_size_2_equal_size_1():
    want, _ = run(1, mixed_requests, async_scheduling=True)
    got_sync, _ = run(2, mixed_requests, async_scheduling=False)
    got_async, stats = run(2, mixed_requests, async_scheduling=True)
    assert_same_outputs(got_sync, want)
    assert_same_outputs(got_async, got_sync)
    assert stats["chain_breaks"] == 0
    assert len({t for o in want.values() for t in o.token_ids}) >= 20  # not a collapsed model


def test_hf_checkpoint_greedy_at_size_2_equals_size_1(hf_dirs):
    path = hf_dirs["qwen2"][0]

    def program(engine, step):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, **G))

    want, _ = run(1, program, model=path)
    got, _ = run(2, program, model=path)
    assert_same_outputs(got, want)


def test_tight_kv_pauses_evictions_and_aborts_at_size_2():
    """Rows grow into a cache too small for all of them (pauses, evictions and recompute),
    while others are aborted, one still waiting and one running."""
    def program(engine, step):
        for i in range(5):
            engine.add_request(f"r{i}", [9 + i] * (12 + 3 * i),
                               SamplingParams(max_tokens=30, temperature=0.8, seed=i,
                                              ignore_eos=True))
        step(3)
        engine.abort("r4")  # not admitted yet
        step(4)
        engine.abort("r1")  # running

    kw = dict(num_kv_blocks=12, block_size=8, max_batch=3)
    want, want_stats = run(1, program, **kw)
    got, stats = run(2, program, **kw)
    assert_same_outputs(got, want)
    assert got["r1"].finish_reason == "abort" and got["r4"].finish_reason == "abort"
    assert stats["pauses"] + stats["evictions"] > 0
    assert (stats["pauses"], stats["evictions"]) == (want_stats["pauses"],
                                                     want_stats["evictions"])
    assert stats["kv_used"] == 0


def test_speculative_self_draft_at_size_2():
    def program(engine, step):
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 60, 7 * i + 2] * 3,
                               SamplingParams(max_tokens=12, logprobs=1 if i == 1 else None,
                                              **G))
            step()

    spec = dict(speculative=SpeculativeConfig("self:1", 2))
    want, _ = run(1, program, **spec)
    got, _ = run(2, program, **spec)
    assert_same_outputs(got, want)
    assert sum(o.num_drafted_tokens for o in got.values()) > 0


# -- faults -----------------------------------------------------------------------------------


def test_killed_worker_makes_step_raise_and_close_ends_every_worker():
    engine = Engine("tiny", tensor_parallel_size=2, **ENGINE)
    try:
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=200, **G))
        for _ in range(3):
            engine.step()
        worker = engine.workers.workers[0].process
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 10
        with pytest.raises(TensorParallelError):  # and every step after it
            engine.step()
    finally:
        engine.close()
    assert not worker.is_alive()
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()  # aborted: a dead peer never leaves with us


def test_close_ends_the_workers():
    with Engine("tiny", tensor_parallel_size=2, **ENGINE) as engine:
        procs = [w.process for w in engine.workers.workers]
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)  # asked to stop, not killed
    assert multiprocessing.active_children() == []
    # the group is left, so the next tensor-parallel engine of this process can start
    assert not torch.distributed.is_initialized()
    with Engine("tiny", tensor_parallel_size=2, **ENGINE) as engine:
        assert len(engine.workers.workers) == 1


def test_the_all_reduce_kind_rank_0_picks(monkeypatch):
    """GRAPHEXEC_ALL_REDUCE picks the kind on CUDA; the CPU and a process that has mapped
    symmetric memory before (a second engine) get the group's own all-reduce; a bad value
    names the variable."""
    from graphexec.parallel import symmetric

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(symmetric, "_mapped_once", False)
    monkeypatch.delenv("GRAPHEXEC_ALL_REDUCE", raising=False)
    assert symmetric.pick(cuda) == "triton" and symmetric.pick(cpu) == "nccl"
    for kind in ("triton", "nccl"):
        monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", kind)
        assert symmetric.pick(cuda) == kind
        assert symmetric.pick(cpu) == "nccl"
    monkeypatch.setattr(symmetric, "_mapped_once", True)
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    assert symmetric.pick(cuda) == "nccl"
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "symm_mem")  # torch's one-shot kind is gone
    with pytest.raises(ValueError, match="GRAPHEXEC_ALL_REDUCE='symm_mem'"):
        symmetric.pick(cuda)
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "custom")
    with pytest.raises(ValueError, match="GRAPHEXEC_ALL_REDUCE='custom'"):
        symmetric.pick(cuda)
    with pytest.raises(ValueError, match="'custom'"):
        symmetric.make_reducer("custom", None, cpu, 2)
    assert symmetric.make_reducer("nccl", None, cpu, 2) is None
    # an engine checks it before any worker starts (workers would wait for rank 0's pick)
    with pytest.raises(ValueError, match="GRAPHEXEC_ALL_REDUCE='custom'"):
        EngineConfig("tiny", device="cpu", tensor_parallel_size=2)
    monkeypatch.setenv("GRAPHEXEC_ALL_REDUCE", "triton")
    with pytest.raises(ValueError, match="at most 8 ranks, got tensor_parallel_size=16"):
        symmetric.check(16)
    symmetric.check(8)


def test_penalised_rows_at_size_2_equal_size_1():
    """Every rank keeps the same penalty slots (the same deltas assign them) and applies them
    to the same gathered logits."""
    def program(engine, step):
        for i in range(5):
            engine.add_request(f"p{i}", [9 + 7 * i, 4, 200 - i] * (i + 1), SamplingParams(
                max_tokens=12, temperature=0.8 * (i % 2), seed=i, ignore_eos=True,
                presence_penalty=0.8, frequency_penalty=0.4 * i, repetition_penalty=1.3,
                min_p=0.05 * (i % 3), logit_bias={30 + i: 4.0}))
            step(i % 2)

    want, _ = run(1, program)
    got, _ = run(2, program, async_scheduling=True)
    assert_same_outputs(got, want)
