import os

import pytest
import torch

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture
def K(monkeypatch):
    """Kernel tests: the Triton modules, every output allocation poisoned."""
    from kernel_helpers import poisoned_triton_modules

    return poisoned_triton_modules(monkeypatch)


def devices():
    """cpu always; cuda as a `gpu`-marked parameter."""
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


HF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": True}),
}


def make_hf_model(path: str, arch: str, seed: int = 0, std: float = 0.3, vocab: int = 320):
    """A small random HF model saved to `path`. Weights are drawn with std 0.3 (not 0.02) so
    greedy decoding does not collapse into repeating a token."""
    import transformers

    cfg_name, model_name, extra = HF_ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """arch -> (dir, HF model) for each architecture."""
    out = {}
    for arch in HF_ARCHS:
        d = str(tmp_path_factory.mktemp(arch))
        out[arch] = (d, make_hf_model(d, arch))
    return out


@pytest.fixture(scope="session")
def hf_dirs_moderate(tmp_path_factory):
    """Like hf_dirs with std 0.1 weights: activations of a realistic size for bf16 comparisons
    (std 0.3 weights blow activations up until bf16 rounding dominates any comparison)."""
    out = {}
    for arch in HF_ARCHS:
        d = str(tmp_path_factory.mktemp(arch + "-moderate"))
        out[arch] = (d, make_hf_model(d, arch, std=0.1))
    return out
