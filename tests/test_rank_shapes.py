"""tools/rank_shapes.py: one tensor-parallel rank's share of a preset as a model of its own."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import rank_shapes  # noqa: E402
from graphexec import LLM, SamplingParams  # noqa: E402
from graphexec.model.config import PRESETS, preset  # noqa: E402


def test_a_rank_of_llama_8b_at_size_2_has_half_its_heads_mlp_and_vocabulary():
    name = rank_shapes.register("llama-8b-tp2rank")
    mc, whole = preset(name), preset("llama-8b")
    assert (mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size) == (
        16, 4, 7168, 64128)
    assert (mc.hidden_size, mc.head_dim, mc.num_layers) == (
        whole.hidden_size, whole.head_dim, whole.num_layers)


def test_other_names_pass_through_untouched():
    before = dict(PRESETS)
    assert rank_shapes.register("llama-1b") == "llama-1b"
    assert rank_shapes.register("some/checkpoint-dir") == "some/checkpoint-dir"
    assert PRESETS == before
    assert not rank_shapes.is_rank_share("llama-1b")


@pytest.mark.parametrize("name, field", [
    ("tiny-tp3rank", "num_heads"),  # 4 heads
    ("tiny-tp1rank", "size"),
    ("nonesuch-tp2rank", "nonesuch"),
])
def test_a_size_that_does_not_split_the_preset_is_refused(name, field):
    with pytest.raises(ValueError, match=field):
        rank_shapes.register(name)
    assert name not in PRESETS


def test_the_share_decodes_at_size_1():
    name = rank_shapes.register("tiny-tp2rank")
    llm = LLM(name, max_batch=2, device="cpu", dtype=torch.float32)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].token_ids) == 4
        assert all(0 <= t < preset(name).vocab_size for t in out[0].token_ids)
    finally:
        llm.close()
