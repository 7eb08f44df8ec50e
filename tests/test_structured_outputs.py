"""Structured outputs (xgrammar) through the engine, on SmolLM2 with its tokenizer, checked by
oracles outside graphexec: outputs parse with `json` and validate with `jsonschema`, regexes
fullmatch with `re`, and a request ends by EOS only where its grammar accepts. Random schemas at
temperature 1 among unconstrained rows; async equals sync token for token; pauses and
evictions; a schema that does not compile is a ValueError and the engine keeps serving."""
import json
import random
import re

import pytest

from graphexec import Engine, SamplingParams
from graphexec.structured import StructuredOutputsParams as S
from test_engine import _same, run_engine

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MODEL = "smollm2-135m"
PROMPT = "Here is a JSON object describing a person:"


def _schema(rng: random.Random) -> dict:
    """A random object schema of bounded output: enums, bounded integers, short strings,
    booleans, a short array, an optional field."""
    kinds = [
        lambda: {"type": "integer", "minimum": rng.randint(-5, 0), "maximum": rng.randint(1, 99)},
        lambda: {"type": "string", "maxLength": rng.randint(1, 10)},
        lambda: {"enum": rng.sample(["red", "green", "blue", "cyan", 7, None], 3)},
        lambda: {"type": "boolean"},
        lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": 3},
    ]
    names = rng.sample(["name", "age", "color", "ok", "tags", "id", "city"], rng.randint(1, 4))
    props = {n: rng.choice(kinds)() for n in names}
    required = names[:max(1, len(names) - 1)]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _requests(n: int, seed: int, lengths=(40, 80)) -> list[tuple[str, str, SamplingParams,
                                                                  object]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 6
        spec, check = None, None
        if kind in (0, 1, 2):
            schema = _schema(rng)
            spec, check = S(json=schema), ("json", schema)
        elif kind == 3:
            spec, check = S(regex=r"[A-Z][a-z]{1,6} [0-9]{2,4}"), ("regex", None)
        elif kind == 4:
            spec, check = S(choice=["yes", "no", "perhaps"]), ("choice", ["yes", "no", "perhaps"])
        params = SamplingParams(max_tokens=rng.choice(lengths), temperature=1.0, seed=i,
                                structured_outputs=spec, presence_penalty=0.3 if i % 4 == 1
                                else 0.0)
        out.append((f"r{i}", PROMPT, params, check))
    return out


def check_output(out, params: SamplingParams, check, eos_ids) -> bool:
    """Whether the output is complete: it then parses and validates (raises otherwise). An
    output cut by max_tokens is a prefix and is not checked whole."""
    if check is None:
        return False
    if out.finish_reason != "stop":
        assert out.finish_reason == "length", out.finish_reason
        return False
    # ended by an end-of-sequence id (a model may have several), which the grammar allowed
    # only here
    assert out.token_ids[-1] in eos_ids, out.token_ids[-1]
    kind, arg = check
    text = out.text
    if kind == "json":
        jsonschema.validate(json.loads(text), arg)
    elif kind == "regex":
        assert re.fullmatch(params.structured_outputs.regex, text), text
    else:
        assert text in arg, text
    return True


@pytest.fixture(scope="module")
def sync_engine():
    return Engine(MODEL, max_model_len=512, max_batch=8, async_scheduling=False)


def test_random_schemas_validate_and_async_equals_sync(sync_engine):
    reqs = _requests(12, seed=1)
    params = [(rid, p, sp) for rid, p, sp, _ in reqs]
    sync = run_engine(sync_engine, params)
    engine = Engine(MODEL, max_model_len=512, max_batch=8, max_num_batched_tokens=64)
    asyn = run_engine(engine, params)
    _same(sync, asyn)
    eos = engine.model_config.eos_token_ids
    complete = sum(check_output(sync[rid], sp, check, eos) for rid, _, sp, check in reqs)
    assert complete >= 6, complete
    assert engine.stats.grammar_waits > 0
    for req in engine.requests.values():
        assert req.grammar is None or req.grammar.rejected == 0


def test_pause_and_eviction_keep_the_grammar():
    """Rows paused and evicted resume with their matchers where their tokens left them: the
    same outputs as with a cache that never runs short, all of them valid."""
    reqs = [r for r in _requests(8, seed=2, lengths=(60,)) if r[3] is not None][:6]
    params = [(rid, p * 4, sp) for rid, p, sp, _ in reqs]  # long prompts: the cache runs short
    ample = run_engine(Engine(MODEL, max_model_len=512, max_batch=8, block_size=4,
                              num_kv_blocks=512), params)
    tight = Engine(MODEL, max_model_len=512, max_batch=8, block_size=4, num_kv_blocks=30)
    _same(ample, run_engine(tight, params))
    assert tight.scheduler.stats.pauses + tight.scheduler.stats.evictions > 0
    eos = tight.model_config.eos_token_ids
    assert sum(check_output(ample[rid], sp, c, eos) for rid, _, sp, c in reqs) >= 3


def test_grammar_and_json_object(sync_engine):
    ebnf = 'root ::= "(" digit+ ("," digit+)* ")"\ndigit ::= [0-9]'
    reqs = [("g", "Numbers:", SamplingParams(max_tokens=40, temperature=1.0, seed=5,
                                             structured_outputs=S(grammar=ebnf))),
            ("o", PROMPT, SamplingParams(max_tokens=80, temperature=0.7, seed=6,
                                         structured_outputs=S(json_object=True)))]
    out = run_engine(sync_engine, reqs)
    if out["g"].finish_reason == "stop":
        assert re.fullmatch(r"\(\d+(,\d+)*\)", out["g"].text), out["g"].text
    else:
        assert re.fullmatch(r"\(\d+(,\d+)*,?\d*", out["g"].text), out["g"].text
    if out["o"].finish_reason == "stop":
        assert isinstance(json.loads(out["o"].text), dict)


def test_bad_grammars_are_value_errors_and_the_engine_serves(sync_engine):
    for spec, field in ((S(json={"type": 5}), "json"), (S(regex="(unclosed"), "regex"),
                        (S(grammar="root ::= undefined_rule"), "grammar")):
        with pytest.raises(ValueError, match=f"structured_outputs.{field} does not compile"):
            sync_engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="structured_outputs"):
        S(json={"type": "object"}, regex="x")
    with pytest.raises(ValueError, match="structured_outputs"):
        S()
    with pytest.raises(ValueError, match="choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs=S(json_object=True), ignore_eos=True)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    out = run_engine(sync_engine, [("ok", PROMPT, SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=S(choice=["a", "b"])))])
    assert out["ok"].text in ("a", "b")


def test_structured_outputs_need_a_tokenizer():
    with pytest.raises(ValueError, match="structured_outputs"):
        Engine("tiny").add_request("x", [1, 2], SamplingParams(
            structured_outputs=S(json_object=True)))


def test_length_bounded_strings_refuse_control_characters():
    """A string with maxLength accepts no raw control character (xgrammar 0.2.8's own rule for
    bounded strings does; graphexec spells the bounds as a pattern). Oracle: json.loads."""
    from graphexec.structured import Grammars, StructuredOutputsParams

    grammars = Grammars.for_vocab([chr(i) for i in range(128)], stop_token_ids=[0])
    schema = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}},
              "required": ["c"], "additionalProperties": False}

    def accepts(text: str) -> bool:
        row = grammars.matcher(StructuredOutputsParams(json=schema))
        for ch in text:
            row.accept(ord(ch))
        return row.rejected == 0

    for text in ['{"c": "a\x07"}', '{"c": "\t"}', '{"c": "abcd"}']:
        assert not accepts(text), repr(text)
    for text in ['{"c": "ab"}', '{"c": ""}']:
        assert accepts(text) and json.loads(text)["c"] == text[7:-2]


def test_length_bounded_strings_take_only_well_formed_utf8():
    """A string with maxLength takes a byte sequence exactly when it decodes as UTF-8 to at
    most that many characters, none of them a quote, a backslash or a control character
    (xgrammar 0.2.8's negated classes took overlong forms, which decode to one replacement
    character a byte). Oracle: Python's strict UTF-8 decoder, over a byte-level vocabulary."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "tools"))
    import synthetic_tokenizer
    from graphexec.structured import Grammars, StructuredOutputsParams

    tok = synthetic_tokenizer.synthetic_tokenizer(512, (1,))
    grammars = Grammars.for_tokenizer(tok, 512, [1])
    byte_token = _byte_tokens(tok)
    schema = {"type": "string", "maxLength": 3}

    def accepts(raw: bytes) -> bool:
        row = grammars.matcher(StructuredOutputsParams(json=schema))
        for b in b'"' + raw + b'"':
            row.accept(byte_token[b])
        return row.rejected == 0

    def well_formed(raw: bytes) -> bool:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return len(text) <= 3 and not any(c in '"\\' or ord(c) < 0x20 for c in text)

    cases = [b"\xf0\x83\xba\x8d", b"\xe3\xba\x8d", b"\xe0\x80\xaf", b"\xc0\xaf",
             b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf0\x9f\x98\x80", b"a\x7fb",
             b"a\x1fb", b"abc", b"abcd", b"\xef\xbf\xbf", b"\xc3\xa9\xc3\xa9\xc3\xa9"]
    # every lead byte against continuation bytes at the edges of their ranges
    edges = (0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0)
    cases += [bytes([lead, b]) for lead in range(0xC0, 0xE0) for b in edges]
    cases += [bytes([lead, b, 0x80]) for lead in range(0xE0, 0xF0) for b in edges]
    cases += [bytes([lead, b, 0x80, 0xBF]) for lead in range(0xF0, 0xF8) for b in edges]
    # every second byte after the leads whose second byte has a narrowed range
    cases += [bytes([lead, b, 0x80]) for lead in (0xE0, 0xED) for b in range(256)]
    cases += [bytes([lead, b, 0x80, 0x80]) for lead in (0xF0, 0xF4) for b in range(256)]
    for raw in cases:
        assert accepts(raw) == well_formed(raw), raw


def _byte_tokens(tok) -> dict[int, int]:
    """byte -> the id of the byte-level vocabulary's token for that one byte."""
    from test_text import _bytes_to_unicode

    return {b: tok._tok.token_to_id(c) for b, c in enumerate(_bytes_to_unicode())}


@pytest.mark.parametrize("vocab", [512, 544])  # 16 and 17 int32 mask words a row
def test_gate_rows_arrive_as_the_launch_rows(vocab):
    """Under a MaskGate the host fills masks and flags apart (capture/mask_gate.py) and the
    device copies them into DecodeState.grammar_rows' layout (kernels/mask_gate.py's
    reference here); the rows that arrive equal grammar_rows', which steps given their masks
    at launch copy whole. Rows: constrained, held, finished, none."""
    import numpy as np
    import torch

    from graphexec.kernels.mask_gate import await_masks_ref
    from graphexec.structured import Grammars, fill_grammar_rows, grammar_rows

    grammars = Grammars.for_vocab([f"t{i}" for i in range(vocab - 4)] + ["{", "}", '"', ":"],
                                  [0])

    class Row:
        def __init__(self, rid, constrained=True, finished=False):
            self.request_id, self.finished = rid, finished
            self.grammar = grammars.matcher(S(json_object=True)) if constrained else None

    rows = [Row("a"), Row("b"), Row("c", finished=True), Row("d", constrained=False), Row("e")]
    rows[4].grammar.accept(vocab - 4)  # "{": a mask unlike the others'
    held = frozenset({"b"})
    masks = np.full((6, grammars.words), -1, dtype=np.int32)
    flags = np.full(6, 5, dtype=np.int64)
    fill_grammar_rows(masks, flags, rows, grammars, held)
    dst = torch.zeros(6, -(-grammars.words // 2) + 1, dtype=torch.int64)
    await_masks_ref(torch.tensor([1]), torch.tensor([0]), torch.tensor([len(rows)]),
                    torch.from_numpy(masks), torch.from_numpy(flags), dst)
    want = grammar_rows(rows, grammars, held)
    assert list(want[:, -1]) == [1, 2, 0, 0, 1]  # MASK_ON, MASK_HOLD, finished, none, MASK_ON
    assert np.array_equal(dst[:len(rows)].numpy(), want)
    assert not np.array_equal(want[0], want[4])
