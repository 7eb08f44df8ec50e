"""Text in and out through the `tokenizers` package: from an HF model dir's tokenizer.json (and
tokenizer_config.json), or rebuilt from a GGUF file's tokenizer.ggml.* metadata."""
from __future__ import annotations

import functools

import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..model.config import read_json_object

if TYPE_CHECKING:
    import tokenizers

    from ..model.gguf import GGUFTokenizerData


class Tokenizer:
    """The subset of transformers' tokenizer interface the engine, the chat template renderer
    and the detokenizer use."""

    def __init__(self, backend: "tokenizers.Tokenizer | str", *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: Iterable[int] = ()):
        if isinstance(backend, str):
            backend = _read_tokenizer_json(backend)
        self._tok = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None and eos_id not in ids:
            ids.insert(0, eos_id)
        self.eos_token_ids: list[int] = ids
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        for tok in (bos_token, eos_token):
            tid = backend.token_to_id(tok) if tok is not None else None
            if tid is not None:
                special.add(tid)
        self.all_special_ids: list[int] = sorted(special | set(ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (a byte-level entry has one per byte):
        a text of n characters is at least n / max_token_chars tokens long."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) become their ids either way;
        add_special_tokens adds what the tokenizer's post-processor adds (a BOS, say)."""
        # encode_batch releases the GIL while it works (encode holds it), so a long prompt
        # tokenised in the server's worker thread does not stall its event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        """Raw vocabulary strings (byte-level BPE spells a space 'Ġ'); None for an unknown id."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]


def _read_tokenizer_json(path: str) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer as _Tok

    try:
        return _Tok.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception for a malformed file
        raise ValueError(f"{path!r} is not a valid tokenizer.json ({e})") from e


def _token_content(tok) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _hf_chat_template(model_dir: str, config: dict) -> str | None:
    # transformers >= 4.43 may save the template beside the config instead of inside it
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


def load_tokenizer(source) -> Tokenizer | None:
    """The tokenizer of a model: `source` is an HF dir, or a loader.ModelSource (GGUF metadata or
    an HF dir); None where the model ships none (presets, a dir without tokenizer.json)."""
    gguf = getattr(source, "gguf", None)
    if gguf is not None:
        from ..model.gguf import tokenizer_data

        data = tokenizer_data(gguf)
        return None if data is None else tokenizer_from_gguf(data, gguf.path)
    if not isinstance(source, str):
        source = source.path if getattr(source, "kind", None) == "hf" else None
    if source is None or not os.path.isdir(source):
        return None
    path = os.path.join(source, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        backend = _read_tokenizer_json(path)
    except ImportError:
        return None
    cfg_path = os.path.join(source, "tokenizer_config.json")
    cfg = read_json_object(cfg_path) if os.path.isfile(cfg_path) else {}
    return Tokenizer(backend, chat_template=_hf_chat_template(source, cfg),
                     bos_token=_token_content(cfg.get("bos_token")),
                     eos_token=_token_content(cfg.get("eos_token")))


# -- GGUF -------------------------------------------------------------------------------------

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before the merges apply, as llama.cpp splits it.
# "digits": each digit on its own, then GPT-2's pattern (the StarCoder family, SmolLM).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, str] = {
    "gpt2": "gpt2", "gpt-2": "gpt2", "default": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's tokenizer.json sets ignore_merges: a whole split that is itself a token stays one.
_IGNORE_MERGES = {_LLAMA3_SPLIT}


def _pre_tokenizer(pre: str | None, path: str):
    from tokenizers import Regex, pre_tokenizers

    split = _PRE_SPLITS.get(pre or "default")
    if split is None:
        warnings.warn(f"model={path!r}: tokenizer.ggml.pre={pre!r} is not known to graphexec; "
                      "splitting text with GPT-2's pattern, which may tokenize differently",
                      stacklevel=3)
        split = "gpt2"
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if split == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), split in _IGNORE_MERGES


def tokenizer_from_gguf(data: "GGUFTokenizerData", path: str) -> Tokenizer | None:
    """A byte-level BPE tokenizer (tokenizer.ggml.model == "gpt2") from the file's vocabulary
    and merges; None, with a warning, for the kinds graphexec does not rebuild (sentencepiece)."""
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as _Tok

    if data.model != "gpt2":
        warnings.warn(f"model={path!r}: tokenizer.ggml.model={data.model!r} is not supported "
                      "(only 'gpt2', byte-level BPE): the model takes token ids only",
                      stacklevel=2)
        return None
    vocab: dict[str, int] = {}
    for i, tok in enumerate(data.tokens):
        vocab.setdefault(tok, i)  # a duplicated spelling keeps its first id
    merges = []
    for m in data.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ValueError(f"model={path!r}: tokenizer.ggml.merges entry {m!r} is not "
                             "two tokens separated by a space")
        merges.append((left, right))
    pre, ignore_merges = _pre_tokenizer(data.pre, path)
    tok = _Tok(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole in the text and dropped by
    # skip_special_tokens; user-defined ones are matched whole but are ordinary text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(data.tokens, data.token_types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(data.tokens, data.token_types) if ty == _USER_DEFINED])
    token = lambda i: data.tokens[i] if i is not None and 0 <= i < len(data.tokens) else None
    bos, eos = token(data.bos_id), token(data.eos_id)
    template, specials = [], []
    if data.add_bos and bos is not None:
        template.append(bos)
        specials.append((bos, data.bos_id))
    template.append("$A")
    if data.add_eos and eos is not None:
        template.append(eos)
        specials.append((eos, data.eos_id))
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(template), special_tokens=list(dict.fromkeys(specials)))
    eos_ids = [i for i in (data.eos_id, data.eot_id) if i is not None]
    return Tokenizer(tok, chat_template=data.chat_template, bos_token=bos, eos_token=eos,
                     eos_token_ids=eos_ids)
