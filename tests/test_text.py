"""Text out: incremental detokenization against whole-output decoding, stop strings (held back
from the stream, cut from the text, the request ended), text in RequestOutput and LLM.generate.

The oracle is the tokenizer's own decode of the whole output. Tokenizers are built here: a
byte-level BPE trained on multilingual text (GPT-2 / Llama 3 style: a CJK character or emoji is
split across tokens) and a SentencePiece-style one with byte fallback (Llama 2 style)."""
import random

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from graphexec import LLM, Engine, SamplingParams, SpeculativeConfig
from graphexec.text.detokenizer import REBASE_AT, IncrementalDetokenizer
from graphexec.text.stop_strings import StopStringMatcher

MULTILINGUAL = ("Héllo wörld, naïve café déjà vu. 中文字符测试，日本語のテキスト。 "
                "Emoji 😀👍🏽🇫🇷 and ĀĒĪ ŌŪ. Ελληνικά κείμενο. Привет, мир!")
# Trained without most of MULTILINGUAL's characters: those stay split into byte tokens, some
# merged across character boundaries (the shared lead bytes of CJK and emoji).
CORPUS = ["the quick brown fox jumps over the lazy dog, Hello world " * 4,
          "中文 中文 测试 测试 😀 😀 é é ö"] * 20


class TextTokenizer:
    """The Tokenizer interface the engine reads (encode / decode / special tokens) over a
    tokenizers.Tokenizer."""

    def __init__(self, tok: Tokenizer, eos: str):
        self.tok = tok
        self.eos_token = eos
        self.bos_token = None
        self.chat_template = None
        self.eos_token_ids = [tok.token_to_id(eos)]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.tok.id_to_token(i) for i in ids]


def byte_level_bpe(vocab_size: int = 512) -> TextTokenizer:
    """Ids 0 and 1 are special ("<|pad|>", "<|eos|>"); the tiny preset's EOS id is 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|eos|>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    return TextTokenizer(tok, "<|eos|>")


def byte_fallback_sp() -> TextTokenizer:
    """Letters are tokens, anything else falls back to <0xNN> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzéö,.!":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return TextTokenizer(tok, "</s>")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are far too small to share out: on a busy machine two threads
    spin against each other (a 4 x 128 x 384 matmul took 8 ms with two, 27 us with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def tokenizers_(bpe):
    return {"byte-level": bpe, "byte-fallback": byte_fallback_sp()}


def stream(tok, ids, chunks, skip=True) -> list[str]:
    """The deltas of feeding `ids` in pieces of the given sizes (cycled), flush included."""
    detok = IncrementalDetokenizer(tok, skip)
    out, i, j = [], 0, 0
    while i < len(ids):
        k = chunks[j % len(chunks)]
        out.append(detok.add(ids[i:i + k]))
        i, j = i + k, j + 1
    out.append(detok.flush())
    return out


# -- incremental detokenization -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
@pytest.mark.parametrize("chunks", [[1], [2], [3, 1], [5]])
def test_deltas_add_up_to_the_whole_decode(tokenizers_, kind, chunks):
    tok = tokenizers_[kind]
    ids = tok.encode(MULTILINGUAL * 3)
    # the text really splits characters across tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas = stream(tok, ids, chunks)
    assert "".join(deltas) == tok.decode(ids) == MULTILINGUAL * 3
    # a character is never cut in half: no delta of valid text holds a replacement character
    assert not any("\ufffd" in d for d in deltas)


def test_a_split_character_is_held_until_complete(bpe):
    """One-byte tokens for a four-byte emoji: nothing comes out until the last byte."""
    emoji = "😀".encode()
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    byte_ids = [bpe.tok.token_to_id(table[b]) for b in emoji]
    assert None not in byte_ids
    detok = IncrementalDetokenizer(bpe)
    assert [detok.add([t]) for t in byte_ids] == ["", "", "", "😀"]
    # unfinished bytes at the end come out as whole-output decoding shows them
    detok = IncrementalDetokenizer(bpe)
    assert detok.add(byte_ids[:2]) == ""
    assert detok.flush() == bpe.decode(byte_ids[:2]) == "\ufffd"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (ByteLevel's alphabet, in byte order)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_random_ids_invalid_bytes_included(tokenizers_, kind):
    tok = tokenizers_[kind]
    vocab = tok.tok.get_vocab_size()
    rng = random.Random(0)
    for trial in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 70))]
        chunks = [rng.randint(1, 4) for _ in range(5)]
        for skip in (True, False):
            assert "".join(stream(tok, ids, chunks, skip)) == \
                tok.decode(ids, skip_special_tokens=skip), (trial, ids)


def test_skip_special_tokens(bpe):
    ids = bpe.encode("Bonjour") + [1] + bpe.encode(" 中文") + [0]
    assert "".join(stream(bpe, ids, [1])) == "Bonjour 中文"
    assert "".join(stream(bpe, ids, [1], skip=False)) == "Bonjour<|eos|> 中文<|pad|>"


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.lengths = tok, []
        self.convert_ids_to_tokens = tok.convert_ids_to_tokens

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def test_each_step_decodes_a_short_window(bpe):
    """O(new tokens) per step: the decoded window stays bounded however long the output."""
    counting = _CountingTokenizer(bpe)
    ids = bpe.encode(MULTILINGUAL * 20)
    deltas = stream(counting, ids, [1])
    assert "".join(deltas) == bpe.decode(ids)
    assert len(ids) > 20 * REBASE_AT
    assert max(counting.lengths) <= REBASE_AT + 8  # + a held character's bytes
    assert len(counting.lengths) < 1.2 * len(ids) + 2


# -- stop strings, on their own -------------------------------------------------------------

def feed_all(matcher, deltas, check=True):
    released, matched = [], False
    for d in deltas:
        out, matched = matcher.feed(d, check)
        released.append(out)
        if matched:
            break
    if not matched:
        released.append(matcher.flush())
    return released, matched


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_deltas_is_never_streamed(include):
    text = "The answer is 42.\nUser: next question"
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]  # the stop spans deltas
    released, matched = feed_all(StopStringMatcher(("\nUser:",), include), deltas)
    assert matched
    want = "The answer is 42." + ("\nUser:" if include else "")
    assert "".join(released) == want
    if not include:
        assert not any(c in r for r in released for c in "\nU")


def test_partial_stop_is_released_once_it_cannot_match():
    released, matched = feed_all(StopStringMatcher(("STOP",)), ["go ST", "ORE then STO", "RY"])
    assert not matched and "".join(released) == "go STORE then STORY"
    # held while it may still become the stop string, released as soon as it cannot
    assert released[:2] == ["go ", "STORE then "]


def test_earliest_completed_stop_wins():
    released, matched = feed_all(StopStringMatcher(("cde", "bc", "zz")), ["abcdef"])
    assert matched and released == ["a"]
    released, matched = feed_all(StopStringMatcher(("xbc", "bc")), ["axbcd"])
    assert matched and released == ["a"]  # same end: the longer match


def test_no_match_before_min_tokens():
    m = StopStringMatcher(("ab", "abcd"))
    assert m.feed("xab", check=False) == ("x", False)  # "ab" may begin "abcd": held
    assert m.feed("c") == ("", False)  # the "ab" from before min_tokens does not count
    assert m.feed("x") == ("abcx", False)
    assert m.feed("ab") == ("", True)


# -- through the engine ---------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def run(engine, prompts, params):
    """Streams every request; returns ({id: final output}, {id: list of new_text deltas})."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    final, deltas = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.new_text)
            assert out.text == "".join(deltas[out.request_id])
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(prompts))], \
        [deltas[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engines(bpe):
    made = {}
    for name, kw in (("sync", dict(async_scheduling=False)), ("async", {}),
                     ("spec", dict(speculative=SpeculativeConfig("self:2", 3)))):
        e = Engine("tiny", max_batch=4, num_kv_blocks=64, device="cpu", **kw)
        e.tokenizer = bpe  # a test tokenizer over the random model's 512 ids
        made[name] = e
    yield made
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def reference(engines, bpe):
    prompts = [bpe.encode(s) for s in ("Hello", "中文字符", "😀 café", "the quick")]
    outs, deltas = run(engines["sync"], prompts, [GREEDY] * 4)
    return prompts, outs, deltas


def test_text_streams_and_equals_the_whole_decode(reference, bpe):
    _, outs, deltas = reference
    for out, ds in zip(outs, deltas):
        assert out.text == "".join(ds) == bpe.decode(out.token_ids)
        assert len(out.token_ids) == 40
    assert any(len(set(o.text)) > 5 for o in outs)  # not one repeated character


def _stop_cases(outs):
    """(prompt index, stop string) pairs: two characters of each request's text past its
    first quarter (the random model's text is full of U+FFFD: those are skipped)."""
    cases = []
    for i, out in enumerate(outs):
        text = out.text
        stop = next((text[a:a + 2] for a in range(len(text) // 4, len(text) - 2)
                     if "\ufffd" not in text[a:a + 2]), None)
        if stop is not None:
            cases.append((i, stop))
    assert len(cases) >= 3
    return cases


@pytest.mark.parametrize("mode", ["sync", "async", "spec"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request(engines, reference, bpe, mode, include):
    prompts, outs, _ = reference
    cases = _stop_cases(outs)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                             stop=[s, "\x00\x00\x00"], include_stop_str_in_output=include)
              for _, s in cases]
    got, deltas = run(engines[mode], [prompts[i] for i, _ in cases], params)
    for (i, stop), out, ds in zip(cases, got, deltas):
        full_ids, full_text = outs[i].token_ids, outs[i].text
        at = full_text.find(stop)
        assert out.finish_reason == "stop"
        assert out.text == full_text[:at + (len(stop) if include else 0)]
        assert "".join(ds) == out.text
        if not include:
            assert not any(stop in "".join(ds[:k]) for k in range(len(ds) + 1))
        # the request ends at the token that completes the stop string: later tokens, even
        # from the same speculative step, are dropped
        n = next(n for n in range(1, len(full_ids) + 1) if stop in bpe.decode(full_ids[:n]))
        assert out.token_ids == full_ids[:n]


def test_a_stop_string_that_never_completes_releases_everything(engines, reference):
    prompts, outs, _ = reference
    text = outs[0].text
    stop = text[5:9] + "\x01"  # its first four characters do show up
    got, deltas = run(engines["async"], [prompts[0]],
                      [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop)])
    assert got[0].finish_reason == "length"
    assert got[0].text == "".join(deltas[0]) == text


def test_llm_generate_fills_text_with_stop_strings_cut(reference, bpe):
    prompts, outs, _ = reference
    llm = LLM("tiny", max_batch=4, num_kv_blocks=64, device="cpu")
    llm.engine.tokenizer = bpe
    (i, stop), *_ = _stop_cases(outs)
    res = llm.generate([prompts[i], prompts[i]],
                       [GREEDY, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                               stop=stop)])
    assert res[0].text == outs[i].text
    assert res[1].text == outs[i].text[:outs[i].text.find(stop)]


def test_stop_strings_need_a_tokenizer():
    with Engine("tiny", max_batch=2, num_kv_blocks=16, device="cpu") as engine:
        with pytest.raises(ValueError, match="stop"):
            engine.add_request("a", [1, 2, 3], SamplingParams(stop=["x"]))
        engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=2))
        while engine.has_unfinished():
            for out in engine.step():
                assert out.text is None and out.new_text is None
