"""Model shape and behaviour, read from a HuggingFace config.json or taken from a named preset."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before rotary
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    sliding_window: int | None = None  # the engine caps the context at this window
    init_std: float = 0.02  # only used for random weights

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * per_layer + embed + head + self.hidden_size

    def streamed_parameters(self) -> int:
        """The parameters a decode step reads whole: all but an untied embedding table, of
        which it reads only the batch's rows (a tied one is read whole as the LM head)."""
        untied_embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_parameters() - untied_embed

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs!r} in config.json: "
                f"graphexec supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported (only silu)")
        window = cfg.get("sliding_window")
        if family == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_scaling = _parse_rope_scaling(cfg)
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            family=family,
            sliding_window=window,
        )

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model={path!r}: no config.json in that directory")
        cfg = read_json_object(cfg_path)
        try:
            return cls.from_hf_config(cfg)
        except KeyError as e:
            raise ValueError(f"{cfg_path!r} lacks the field {e.args[0]!r}") from None


def read_json_object(path: str) -> dict:
    """A JSON file that must hold an object (config.json, tokenizer_config.json)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _parse_rope_scaling(cfg: dict) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


_LLAMA3_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# Shapes of public checkpoints, with random weights: tests and benchmarks need no download.
PRESETS: dict[str, ModelConfig] = {
    # Large init (std 0.3) so greedy decoding of random weights does not collapse into repeating
    # the last token, which would let a broken engine pass the tests.
    "tiny": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048,
                        rope_theta=10000.0, eos_token_ids=(1,), init_std=0.3),
    "llama-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                            num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                            max_position_embeddings=131072, rope_theta=500000.0,
                            rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True,
                            eos_token_ids=(128001, 128008, 128009)),
    "llama-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=131072, rope_theta=500000.0,
                            rope_scaling=_LLAMA3_ROPE, eos_token_ids=(128001, 128008, 128009)),
    # Llama 3.1 70B: the shape tensor parallelism is for (140 GB of bf16 weights).
    "llama-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                             num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=131072, rope_theta=500000.0,
                             rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                      high_freq_factor=4.0,
                                                      original_max_position_embeddings=8192),
                             eos_token_ids=(128001, 128008, 128009)),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              max_position_embeddings=40960, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True,
                              eos_token_ids=(151645, 151643), family="qwen3"),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model={name!r} is neither a directory nor a preset ({sorted(PRESETS)})")
    return replace(PRESETS[name], **overrides)
