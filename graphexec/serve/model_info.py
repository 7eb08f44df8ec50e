"""What the request handlers need to know about the engine, read once when it is built.

Handlers run on the event loop and never touch the Engine (its process owns it); they validate
against this frozen copy instead, which the engine process sends once it is built. The
tokenizer travels with it (a `tokenizers` tokenizer pickles): prompts are encoded on the HTTP
side, outputs decoded on the engine side."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    max_model_len: int
    vocab_size: int
    # Prompt + output tokens one request can hold if it had the whole KV cache: a request that
    # needs more is refused (the engine would refuse it too, see Engine._check_fits).
    kv_capacity_tokens: int
    kv_blocks: int
    block_size: int  # tokens per KV block (data-parallel routing keys prompts by blocks)
    tokenizer: object | None
    # The tokenizer's longest vocabulary entry, in characters (None without a tokenizer): a
    # prompt far past the context in characters is refused without being tokenised.
    max_token_chars: int | None = None

    @classmethod
    def of(cls, engine) -> "ModelInfo":
        blocks = engine.pool.num_blocks
        return cls(max_model_len=engine.max_model_len,
                   vocab_size=engine.model_config.vocab_size,
                   kv_capacity_tokens=blocks * engine.config.block_size - engine.runner.k,
                   kv_blocks=blocks, block_size=engine.config.block_size,
                   tokenizer=engine.tokenizer,
                   max_token_chars=(engine.tokenizer.max_token_chars
                                    if engine.tokenizer is not None else None))
