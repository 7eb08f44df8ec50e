"""Optional text in and out, through the `tokenizers` package and a model dir's tokenizer.json."""
from __future__ import annotations

import os


class Tokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        return Tokenizer(path)
    except ImportError:
        return None
