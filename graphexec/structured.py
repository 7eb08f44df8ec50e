"""Structured outputs on xgrammar: what a request asks for (StructuredOutputsParams, vLLM's
names), its compiled grammar, and the matcher that follows its tokens on the host.

The host advances each row's matcher as its tokens are reconciled and writes the bitmask of the
tokens the grammar allows next (one bit per vocabulary entry, xgrammar's layout) into the step's
mask rows; the captured sampler sets every other token to -inf (kernels/token_mask.py). The mask
of step n + 1 depends on the token of step n: on one GPU with graphs, step n + 1 is launched
first and waits on the device for its masks, which the host fills once it has read step n
(capture/mask_gate.py); elsewhere the engine reads each step before it plans the next
(graphexec/engine.py).

Under speculative decoding the host knows the mask of a step's first position only, so grammar
rows take no drafts: one masked token a step (capture/spec_controls.py). A grammar row joining
in a speculative step samples its first token in the prefill and is held for the rest of that
step (MASK_HOLD): its next mask follows a token the host has not read yet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# What the compiler's cache of compiled grammars may hold: unbounded (xgrammar's default), a
# client sending one new large grammar after another would grow the engine without end.
GRAMMAR_CACHE_BYTES = 256 << 20
# A row's grammar flag (the last word of its DecodeState.grammar_rows row): 0 no grammar, else
# its mask applies; MASK_HOLD also tells a speculative step to emit nothing for the row (it
# joined in this step, and its next mask follows a token the host has not read yet).
MASK_ON, MASK_HOLD = 1, 2


@dataclass
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its text), regex, choice (the output
    is one of these strings), grammar (EBNF, xgrammar's dialect), json_object=True (any JSON
    object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its "
                             f"text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a request's error, not the engine's
        raise ValueError(f"structured_outputs needs xgrammar (make install): {e}") from None
    return xgrammar


class Grammars:
    """One engine's compiler (over its vocabulary) and the matchers of its requests."""

    def __init__(self, info):
        xgr = _xgrammar()

        self.info = info  # xgrammar.TokenizerInfo
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.words = (info.vocab_size + 31) // 32  # int32 words of one row's mask
        self._xgr = xgr
        # Fills the masks of a step's grammar rows on several threads: one row's mask can take
        # a few hundred microseconds over a 128k vocabulary (inside a string), one per row.
        self.batch = xgr.BatchGrammarMatcher()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> "Grammars":
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerFast

        # xgrammar reads the vocabulary and how it is encoded (byte-level, byte fallback)
        # from a transformers tokenizer; ours wraps the same `tokenizers` object.
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
        return cls(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                      stop_token_ids=stop_token_ids))

    @classmethod
    def for_vocab(cls, vocab: list[str], stop_token_ids: list[int]) -> "Grammars":
        """Over a plain vocabulary, token i spelling vocab[i] (a model without a tokenizer:
        the tests' random-weight presets)."""
        xgr = _xgrammar()

        return cls(xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                                     stop_token_ids=stop_token_ids))

    def matcher(self, params: StructuredOutputsParams, compiled=None) -> "RowGrammar":
        """A matcher at the start of the grammar, compiled now unless `compiled` is given."""
        if compiled is None:
            compiled = self.compile(params)
        return RowGrammar(self._xgr.GrammarMatcher(compiled))

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; a ValueError with the compiler's message if it does not
        compile. Thread-safe, and the compiler does not hold the GIL: the server compiles off
        the engine's thread (serve/engine_core.py)."""
        kind = params.kind
        value: Any = getattr(params, kind)
        c = self.compiler
        try:
            if kind == "json":
                schema = json.loads(value) if isinstance(value, str) else value
                compiled = c.compile_json_schema(json.dumps(bounded_strings_plain(schema)))
            elif kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = c.compile_regex(value)
            elif kind == "choice":
                compiled = c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(s) for s in value))
            else:
                compiled = c.compile_grammar(value)
        except Exception as e:  # xgrammar raises RuntimeError (and others) for bad input
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None
        return compiled


class RowGrammar:
    """One request's matcher: the tokens accepted so far (grammar_rows fills the masks)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.rejected = 0  # tokens the grammar refused (a masked sampler never draws one)

    def accept(self, token: int) -> None:
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            self.rejected += 1


# One unescaped JSON string character, as exact UTF-8 (bounded_strings_plain says why so spelled).
_JSON_STRING_CHAR = (r"([ !#-\[\]-\x7F]|[\x80-\u07FF]|[\u0800-\uD7FF]|[\uE000-\uFFFF]"
                     r"|[\u{10000}-\u{10FFFF}])")


def bounded_strings_plain(schema: Any) -> Any:
    r"""The schema with each string bounded by minLength / maxLength (and nothing else that
    shapes it) spelled as a pattern of unescaped characters: xgrammar 0.2.8's rule for
    length-bounded strings lets raw control characters through, which no JSON parser takes
    (found by tools/fuzz_structured.py). Its pattern rule excludes them; the pattern admits a
    subset of the strings the bounds do (no escapes), all valid JSON. Each character is one of
    five classes split by UTF-8 length, listing what they admit: xgrammar matches a negated
    class by decoding UTF-8 leniently, so overlong forms (F0 83 BA 8D for U+3E8D) and UTF-16
    surrogates got through, and a decoder turns each of their bytes into a replacement
    character, past the length bound. One class over every plane (ending \U0010FFFF) was
    exact too but took 80 times as long to fill a mask inside a string (0.73 against 0.009 ms
    over 128k tokens), past the GPU's step at 64 rows; spelled as here it is exact and fast.
    tests/test_structured_outputs.py checks it against Python's strict decoder."""
    if isinstance(schema, list):
        return [bounded_strings_plain(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_plain(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if (out.get("type") == "string" and bounded
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = "^" + _JSON_STRING_CHAR + f"{{{lo},{hi}}}$"
    return out


def grammar_rows(rows: list, grammars: Grammars, held: frozenset[str] = frozenset()
                 ) -> np.ndarray:
    """Every row's next-token mask and grammar flag, in DecodeState.grammar_rows' layout: int64
    words of two int32 mask words each, then the flag. held: request ids of grammar rows whose
    speculative step emits nothing (flag MASK_HOLD)."""
    masks = np.zeros((len(rows), grammars.words), dtype=np.int32)
    out = np.zeros((len(rows), -(-grammars.words // 2) + 1), dtype=np.int64)
    fill_grammar_rows(masks, out[:, -1], rows, grammars, held)
    out[:, :-1].view(np.int32)[:, :grammars.words] = masks
    return out


def fill_grammar_rows(masks: np.ndarray, flags: np.ndarray, rows: list, grammars: Grammars,
                      held: frozenset[str] = frozenset()) -> None:
    """Writes the masks of `rows` into masks[:len(rows)] (int32, grammars.words a row, as
    xgrammar fills them: no copy) and their flags into flags[:len(rows)]. Rows without a
    grammar, or already finished (a step launched before the host saw the finish): flag 0,
    mask words left as they are."""
    flags[:len(rows)] = 0
    idx = [i for i, req in enumerate(rows) if req.grammar is not None and not req.finished]
    if not idx:
        return
    grammars.batch.batch_fill_next_token_bitmask([rows[i].grammar.matcher for i in idx], masks,
                                                 idx)
    for i in idx:
        flags[i] = MASK_HOLD if rows[i].request_id in held else MASK_ON
