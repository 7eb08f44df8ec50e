"""A stand-in tokenizer for the random-weight presets, which ship none: a byte-level BPE trained
in memory on text in this repository (docs, sources) plus generated JSON, topped up to the
preset's vocabulary size with spelling variants of its words, as a real vocabulary has them.

Its purpose is xgrammar: the mask a grammar row costs depends on how many vocabulary entries
there are and what they spell (multi-character words, `{"`, `":`, numbers), so a benchmark of
constrained decoding on llama-1b needs 128,256 entries that look like an LLM's, and eos tokens
at the preset's eos ids. It is deterministic for a given tree and trains in seconds.

    python tools/synthetic_tokenizer.py --model llama-1b --out /tmp/tok   # writes tokenizer.json
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import sys
import tempfile
from typing import TYPE_CHECKING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from graphexec.text.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

if TYPE_CHECKING:
    import tokenizers

# Text that ships with the repo, read in sorted order so the merges are the same each time.
CORPUS_GLOBS = ("README.md", "docs/*.md", "graphexec/**/*.py", "capture/*.py", "kernels/*.py",
                "tools/*.py", "tests/*.py")
EOS_NAME = "<|end_of_text|>"
_WORDS = ("id", "name", "title", "type", "value", "items", "count", "status", "email", "score",
          "tags", "city", "price", "enabled", "created_at", "description", "version", "kind")


def _repo_text() -> str:
    paths = sorted({p for g in CORPUS_GLOBS for p in glob.glob(os.path.join(ROOT, g),
                                                              recursive=True)})
    parts = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return "\n".join(parts)


def _json_text(n: int = 4000, seed: int = 0) -> str:
    """Generated JSON documents, compact and indented, so the merges include the punctuation
    runs constrained outputs are made of (`{"`, `":`, `",`, `"}`, `":[`)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        keys = rng.sample(_WORDS, rng.randint(2, 7))
        obj = {}
        for k in keys:
            r = rng.random()
            obj[k] = (rng.randint(-999, 99999) if r < 0.3 else round(rng.uniform(-100, 100), 3)
                      if r < 0.4 else rng.random() < 0.5 if r < 0.5 else None if r < 0.55
                      else [rng.choice(_WORDS) for _ in range(rng.randint(0, 4))] if r < 0.7
                      else " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 4))))
        docs.append(json.dumps(obj, indent=None if i % 2 else 2))
    return "\n".join(docs)


def _variants(token: str) -> list[str]:
    """Spellings a real vocabulary holds beside a word token: with and without the leading
    space ('Ġ' in byte-level), capitalised, upper case."""
    bare = token[1:] if token.startswith("Ġ") else token
    if not bare.isalpha():
        return []
    out = []
    for w in (bare, bare.capitalize(), bare.upper()):
        out += [w, "Ġ" + w]
    return out


def _top_up(vocab: dict[str, int], size: int) -> list[str]:
    """Entries past what the corpus trains: word variants, then numbers, then made-up words.
    They have no merges, so encoding never produces them; they exist for the grammar mask."""
    extra: list[str] = []
    seen = set(vocab)

    def add(t: str) -> bool:
        if t not in seen:
            seen.add(t)
            extra.append(t)
        return len(extra) >= size

    for tok in sorted(vocab, key=vocab.__getitem__):
        for v in _variants(tok):
            if add(v):
                return extra
    for n in range(1000):  # Llama 3 spells every number below 1000 as one token
        if add(str(n)) or add("Ġ" + str(n)):
            return extra
    # Then made-up words: two trained word pieces joined, as subwords of a larger corpus.
    # Short pieces keep the mean entry near a real vocabulary's (about 6 characters).
    pieces = sorted(t for t in vocab if t.lstrip("Ġ").isalpha() and 1 < len(t) <= 5)
    heads, tails = pieces, [t for t in pieces if not t.startswith("Ġ")]
    rng = random.Random(1)
    while not add(rng.choice(heads) + rng.choice(tails)):
        pass
    return extra


def build(vocab_size: int, eos_token_ids: tuple[int, ...] | list[int]) -> "tokenizers.Tokenizer":
    """A `tokenizers` byte-level BPE with exactly vocab_size entries; eos_token_ids[0] spells
    EOS_NAME and every eos id is a special token."""
    from tokenizers import AddedToken, Tokenizer as Tok, decoders, models, pre_tokenizers, trainers

    eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
    if not eos or max(eos) >= vocab_size:
        raise ValueError(f"eos ids {eos} must be in [0, {vocab_size})")
    if vocab_size < 256 + len(eos):
        raise ValueError(f"vocab_size {vocab_size}: byte-level needs 256 + {len(eos)} entries")
    trained = vocab_size - len(eos)
    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=trained, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = _repo_text() + "\n" + _json_text()
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    learned: dict[str, int] = model["vocab"]
    order = sorted(learned, key=learned.__getitem__)
    order += _top_up(learned, trained - len(order))
    # Regular entries take the ids the eos tokens leave free, in trained order.
    specials = {i: EOS_NAME if k == 0 else f"<|eos_{k}|>" for k, i in enumerate(eos)}
    free = (i for i in range(vocab_size) if i not in specials)
    vocab = {t: next(free) for t in order}
    vocab.update({t: i for i, t in specials.items()})
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in model["merges"]]
    out = Tok(models.BPE(vocab=vocab, merges=merges))
    out.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    out.decoder = decoders.ByteLevel()
    out.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in specials.values()])
    return out


def save(backend, out_dir: str) -> str:
    """tokenizer.json and tokenizer_config.json (naming the eos token), as an HF dir has them."""
    os.makedirs(out_dir, exist_ok=True)
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS_NAME}, f)
    return out_dir


def synthetic_tokenizer(vocab_size: int, eos_token_ids, out_dir: str | None = None) -> Tokenizer:
    """graphexec's Tokenizer over build(), loaded back from disk the way a model dir's is."""
    backend = build(vocab_size, eos_token_ids)
    if out_dir is not None:
        return load_tokenizer(save(backend, out_dir))
    with tempfile.TemporaryDirectory() as d:
        return load_tokenizer(save(backend, d))


def for_model(model: str, out_dir: str | None = None) -> Tokenizer:
    """A synthetic tokenizer sized for a preset (its vocab_size and eos ids)."""
    from graphexec.model import preset

    mc = preset(model)
    return synthetic_tokenizer(mc.vocab_size, mc.eos_token_ids, out_dir)


def fingerprint(tok: Tokenizer) -> str:
    """A short hash of the vocabulary: two runs compare only if it matches (the corpus is this
    tree's text, so it moves with the sources)."""
    vocab = tok._tok.get_vocab(with_added_tokens=True)
    blob = "\n".join(sorted(f"{i} {t}" for t, i in vocab.items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tok = for_model(args.model, args.out)
    multi = sum(len(t) > 1 for t in tok._tok.get_vocab())
    print(f"{args.out}: {tok.vocab_size} entries ({multi} multi-character), eos "
          f"{tok.eos_token_ids}, fingerprint {fingerprint(tok)}")


if __name__ == "__main__":
    main()
