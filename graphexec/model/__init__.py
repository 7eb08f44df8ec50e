from .config import PRESETS, ModelConfig, preset
from .llama import AttentionInputs, KVCache, LlamaModel, ModelWeights
from .loader import (SHIPPED_MODELS, ModelSource, load_model, load_weights, random_weights,
                     resolve_model)

__all__ = ["PRESETS", "ModelConfig", "preset", "AttentionInputs", "KVCache", "LlamaModel",
           "ModelWeights", "load_weights", "random_weights", "SHIPPED_MODELS", "ModelSource",
           "load_model", "resolve_model"]
