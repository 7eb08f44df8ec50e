"""Incremental detokenization: a request's growing token list turned into text deltas.

Decoding the whole output at every step would cost O(output) per step. Instead each step decodes
a short window: a few tokens whose text was already handed out (context: byte pieces merge and
leading spaces are stripped or kept depending on what precedes a token) followed by the new
ones, and hands out what the new ones added.

A character whose UTF-8 bytes are split across tokens decodes to U+FFFD until its last byte
arrives (byte-level BPE decodes lossily), so the trailing U+FFFD characters of a window are held
back until a later token settles them or the request ends. SentencePiece byte fallback decodes
each run of byte tokens (`<0xE4>`) as a whole, and a run that was valid UTF-8 turns into U+FFFD
throughout when an invalid byte joins it: the text of a trailing run of byte tokens is held
until the run ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT = "\ufffd"
# Context tokens kept in the window when it is cut back, and the window length that triggers
# the cut: each step decodes at most REBASE_AT + (new tokens) tokens.
CONTEXT = 4
REBASE_AT = 16


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # optional: without it byte-fallback runs are not recognised
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]: ...


def _is_byte_token(token: str | None) -> bool:
    # the spelling SentencePiece byte fallback uses, and the tokenizers decoder recognises
    return token is not None and len(token) == 6 and token.startswith("<0x") and token[5] == ">"


@dataclass
class IncrementalDetokenizer:
    """Feed it the new tokens of each step; it returns the text they complete. The concatenation
    of everything it returns (flush included) equals decoding the whole output at once."""

    tokenizer: Decoder
    skip_special_tokens: bool = True
    # The tokens decoded each step: context whose text is out, then the tokens after it.
    _window: list[int] = field(default_factory=list)
    # Characters of decode(_window) already handed out; the rest is held (trailing U+FFFD).
    _emitted: int = 0
    _byte_run: int = 0  # byte-fallback tokens at the end of the window

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self._window.extend(ids)
        self._count_byte_run(ids)
        text = self._decode(self._window)
        end = len(text)
        if self._byte_run:  # the run's text is not final before the run ends
            end = len(self._decode(self._window[:-self._byte_run]))
        while end > self._emitted and text[end - 1] == REPLACEMENT:
            end -= 1
        end = max(end, self._emitted)
        delta = text[self._emitted:end]
        self._emitted = end
        if end == len(text) and len(self._window) > REBASE_AT:
            self._rebase(text)
        return delta

    def flush(self) -> str:
        """The held tail, as whole-output decoding renders it (U+FFFD for unfinished bytes)."""
        if not self._window:
            return ""
        text = self._decode(self._window)
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta

    def _rebase(self, text: str) -> None:
        """Cuts the window back to its last few tokens. Valid only where the short window decodes
        to the very tail of the long one (no byte sequence or byte-fallback run cut in half, no
        leading space stripped differently); otherwise the window stays as it is for now."""
        for start in range(len(self._window) - CONTEXT, len(self._window) - 2 * CONTEXT, -1):
            if start <= 0:
                return
            tail = self._decode(self._window[start:])
            if text.endswith(tail):
                self._window = self._window[start:]
                self._emitted = len(tail)
                return

    def _count_byte_run(self, ids: list[int]) -> None:
        to_tokens = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if to_tokens is None:
            return
        for token in to_tokens(ids):
            self._byte_run = self._byte_run + 1 if _is_byte_token(token) else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
