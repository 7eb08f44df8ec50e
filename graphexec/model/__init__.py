from .config import PRESETS, ModelConfig, preset
from .llama import AttentionInputs, KVCache, LlamaModel, ModelWeights
from .loader import load_weights, random_weights

__all__ = ["PRESETS", "ModelConfig", "preset", "AttentionInputs", "KVCache", "LlamaModel",
           "ModelWeights", "load_weights", "random_weights"]
