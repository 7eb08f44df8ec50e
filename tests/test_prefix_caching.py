"""Prefix caching: full prompt blocks reused by later requests that start the same way. The
oracle is the same requests with caching off, in sync mode; the KV a cached block holds must
equal a fresh prefill of its tokens."""
import random

import pytest
import torch

from graphexec import Engine, SamplingParams, SpeculativeConfig
from graphexec.model import AttentionInputs, KVCache
from test_engine import _same, run_engine

SYSTEM = [random.Random(5).randrange(2, 512) for _ in range(100)]


def _engine(async_scheduling: bool, caching: bool, **kw) -> Engine:
    opts = dict(max_batch=6, num_kv_blocks=256, max_model_len=1024, seed=1,
                async_scheduling=async_scheduling, enable_prefix_caching=caching)
    opts.update(kw)
    return Engine("tiny", **opts)


def _shared_requests(n: int, seed: int, prefix=SYSTEM):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        suffix = [rng.randrange(2, 512) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(max_tokens=rng.randint(1, 16),
                                temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True,
                                logprobs=1 if i % 3 == 0 else None)
        out.append((f"r{i}", prefix + suffix, params))
    return out


def _run_waves(engine: Engine, waves) -> dict:
    """Each wave is submitted after the one before has finished, so later waves find the
    earlier ones' blocks cached."""
    out = {}
    for wave in waves:
        out.update(run_engine(engine, wave))
    return out


@pytest.mark.parametrize("budget", [4096, 24])
def test_cached_async_equals_uncached_sync(budget):
    waves = [_shared_requests(4, seed=1), _shared_requests(8, seed=2)]
    plain = _run_waves(_engine(False, False), waves)
    cached = _engine(True, True, max_num_batched_tokens=budget)
    _same(plain, _run_waves(cached, waves))
    stats = cached.stats_summary()
    # the second wave's 8 prompts each take the 6 full blocks of the shared system prompt
    assert stats["prefix_hit_tokens"] >= 8 * 96
    assert stats["prefix_query_tokens"] == sum(len(p) for w in waves for _, p, _ in w)
    assert stats["cached_blocks"] > 0
    assert cached.pool.num_free == cached.pool.num_blocks  # cached blocks are free, evictable


def test_a_prompt_equal_to_a_cached_one_still_prefills_its_last_token():
    prompt = SYSTEM[:96]  # exactly 6 full blocks
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = run_engine(_engine(False, False), [("a", prompt, p)])
    cached = _engine(True, True)
    run_engine(cached, [("warm", prompt, p)])
    again = run_engine(cached, [("a", prompt, p)])
    assert again["a"].token_ids == plain["a"].token_ids
    assert cached.scheduler.stats.prefix_hit_tokens == 5 * 16  # the 6th block holds the last


def test_multi_turn_conversation_hits_its_earlier_turns():
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engines = (_engine(False, False), _engine(True, True))
    outs = []
    for engine in engines:
        history, turns = list(SYSTEM), []
        for turn in range(3):
            history += [10 + turn] * 20  # the user's message
            out = run_engine(engine, [(f"t{turn}", list(history), p)])[f"t{turn}"]
            history += out.token_ids
            turns.append(out.token_ids)
        outs.append(turns)
    assert outs[0] == outs[1]
    # turns 2 and 3 reuse every full block of the prompt before them
    assert engines[1].scheduler.stats.prefix_hit_tokens >= 2 * 112


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_recompute_after_eviction_hits_the_cache(async_scheduling):
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    reqs = [(f"r{i}", SYSTEM[:64] + [20 + i] * 30, p) for i in range(5)]
    ample = run_engine(_engine(False, False, block_size=4), reqs)
    tight = _engine(async_scheduling, True, block_size=4, num_kv_blocks=60)
    _same(ample, run_engine(tight, reqs))
    assert tight.scheduler.stats.evictions > 0
    assert tight.scheduler.stats.prefix_hit_tokens > 0
    assert tight.pool.num_free == tight.pool.num_blocks


def test_speculative_decoding_with_caching():
    waves = [_shared_requests(3, seed=4), _shared_requests(5, seed=6)]
    spec = dict(speculative=SpeculativeConfig("self:1", 2))
    plain = _run_waves(_engine(False, False, **spec), waves)
    cached = _engine(True, True, **spec)
    _same(plain, _run_waves(cached, waves))
    assert cached.scheduler.stats.prefix_hit_tokens > 0


def test_abort_of_a_request_holding_shared_blocks():
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = _engine(True, True)
    run_engine(engine, [("warm", SYSTEM + [3], p)])
    engine.add_request("a", SYSTEM + [4], p)
    engine.add_request("b", SYSTEM + [5], p)
    engine.step()
    engine.step()
    shared = set(engine.requests["a"].blocks) & set(engine.requests["b"].blocks)
    assert len(shared) == 6
    engine.abort("a")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].finish_reason == "abort" and done["b"].finish_reason == "length"
    alone = run_engine(_engine(False, False), [("b", SYSTEM + [5], p)])
    assert done["b"].token_ids == alone["b"].token_ids
    assert engine.pool.num_free == engine.pool.num_blocks


def fresh_prefill_kv(engine: Engine, tokens: list[int]) -> KVCache:
    """The KV a whole-prompt prefill of `tokens` writes into an empty cache of its own, blocks
    0.. in order: what any cached block of that chain must hold."""
    bs, mc = engine.config.block_size, engine.model_config
    n_blocks = -(-len(tokens) // bs)
    shape = (n_blocks, bs, mc.num_kv_heads, mc.head_dim)
    kv = KVCache([torch.zeros(shape) for _ in range(mc.num_layers)],
                 [torch.zeros(shape) for _ in range(mc.num_layers)])
    t = len(tokens)
    attn = AttentionInputs(slot_mapping=torch.arange(t),
                           block_tables=torch.arange(n_blocks, dtype=torch.int32)[None],
                           seq_lens=torch.tensor([t], dtype=torch.int32),
                           cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32))
    engine.model.forward(torch.tensor(tokens), torch.arange(t), attn, kv)
    return kv


def check_cached_blocks_hold_their_prefix(engine: Engine, chains: list[list[int]]) -> int:
    """Every cached block whose key is one of `chains`' block keys holds the KV a fresh
    prefill of that chain writes there, up to fp32 reduction order (the block may have been
    written by a chunk of another size). Returns how many blocks were checked."""
    from graphexec.block_pool import chain_hashes

    bs, checked = engine.config.block_size, 0
    for tokens in chains:
        keys = chain_hashes(tokens, bs, len(tokens) // bs)
        blocks = [engine.pool.lookup(k) for k in keys]
        if not any(b is not None for b in blocks):
            continue
        fresh = fresh_prefill_kv(engine, tokens)
        for j, block in enumerate(blocks):
            if block is None:
                continue
            for layer in range(len(fresh.k)):
                torch.testing.assert_close(engine.kv.k[layer][block], fresh.k[layer][j],
                                           rtol=1e-3, atol=1e-4)
                torch.testing.assert_close(engine.kv.v[layer][block], fresh.v[layer][j],
                                           rtol=1e-3, atol=1e-4)
            checked += 1
    return checked


def test_cached_blocks_hold_a_fresh_prefill_of_their_tokens():
    waves = [_shared_requests(4, seed=1), _shared_requests(6, seed=2)]
    engine = _engine(True, True, max_num_batched_tokens=24)
    _run_waves(engine, waves)
    assert check_cached_blocks_hold_their_prefix(
        engine, [p for w in waves for _, p, _ in w]) >= 6


def test_enable_prefix_caching_is_validated():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Engine("tiny", enable_prefix_caching="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_async_equals_uncached_sync_in_bf16_with_graphs():
    """With batch-invariant kernels a cached block's KV is bitwise what recomputing it gives,
    so bf16 with graphs and caching equals bf16 without caching, token for token."""
    waves = [_shared_requests(4, seed=1), _shared_requests(8, seed=2)]
    opts = dict(device="cuda", dtype="bfloat16", batch_invariant=True, cuda_graphs=True,
                buckets=[1, 2, 4, 8], max_batch=8)
    plain = _run_waves(_engine(False, False, **opts), waves)
    cached = _engine(True, True, max_num_batched_tokens=64, **opts)
    _same(plain, _run_waves(cached, waves))
    assert cached.scheduler.stats.prefix_hit_tokens > 0
