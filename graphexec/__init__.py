"""graphexec: decode Llama-family models from a paged KV cache, one CUDA graph per iteration."""
from .engine import Engine
from .llm import LLM
from .outputs import RequestOutput, TokenLogprob
from .sampling_params import SamplingParams

__all__ = ["Engine", "LLM", "RequestOutput", "SamplingParams", "TokenLogprob"]
