"""tools/bench_sampling.py on the tiny preset (CPU, few steps: it checks the tool, it measures
nothing) and tools/synthetic_tokenizer.py, the vocabulary its JSON modes compile against."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import synthetic_tokenizer  # noqa: E402

SAMPLES = ["hello world", '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
           "naïve café, Straße, 東京, Ελληνικά 🚀", "  indented\n\ttabs\r\n", "a\x00b\x7fc", ""]


LLAMA_EOS = (128001, 128008, 128009)


@pytest.mark.parametrize("vocab_size, eos", [(512, (1,)), (128256, LLAMA_EOS)])
def test_synthetic_tokenizer_round_trips_text_at_the_requested_size(vocab_size, eos):
    tok = synthetic_tokenizer.synthetic_tokenizer(vocab_size, eos)
    assert tok.vocab_size == vocab_size
    assert tok.eos_token_ids[0] == eos[0]
    assert set(eos) <= set(tok.all_special_ids)
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < vocab_size and i not in eos for i in ids)
        assert tok.decode(ids) == s


def test_synthetic_tokenizer_is_deterministic_and_looks_like_an_llm_vocab():
    a = synthetic_tokenizer.synthetic_tokenizer(128256, (128001,))
    b = synthetic_tokenizer.synthetic_tokenizer(128256, (128001,))
    assert synthetic_tokenizer.fingerprint(a) == synthetic_tokenizer.fingerprint(b)
    vocab = a._tok.get_vocab()
    assert sum(len(t) > 1 for t in vocab) > 0.9 * len(vocab)
    for t in ('{"', '":', '",', '"}', "Ġ{\"", "Ġtrue"):  # 'Ġ' is a space in byte-level
        assert t in vocab, t
    # JSON punctuation comes out as multi-character tokens, as it does from a real tokenizer
    assert len(a.encode('{"name": "x"}')) < len('{"name": "x"}') - 4


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    pytest.importorskip("xgrammar")
    import bench_sampling

    out = tmp_path_factory.mktemp("sampling")
    rows = bench_sampling.main(["--model", "tiny", "--device", "cpu", "--batch", "4",
                                "--prompt", "8", "--new", "6", "--repeats", "1", "--out",
                                str(out), "--modes", "json_all", "json_one", "penalties",
                                "plain"])
    return bench_sampling, rows, out


def test_bench_reports_each_mode_against_plain(bench, capsys):
    bs, rows, out = bench
    assert [r["mode"] for r in rows] == ["plain", "json_all", "json_one", "penalties"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["output_tokens"] > 0
        assert "gpu_idle_frac" in r and "grammar_waits" in r
    by = {r["mode"]: r for r in rows}
    assert by["plain"]["output_tokens"] == 4 * 6 and by["plain"]["grammar_waits"] == 0
    assert by["json_all"]["constrained_rows"] == 4 and by["json_one"]["constrained_rows"] == 1
    assert by["json_all"]["grammar_waits"] > 0  # async reads each grammar step before the next
    saved = json.loads((out / "sampling_tiny.json").read_text())
    assert saved["model"] == "tiny" and saved["synthetic_tokenizer"]
    assert [r["mode"] for r in saved["rows"]] == [r["mode"] for r in rows]
    table = bs.table(rows).splitlines()
    assert table[0].startswith("| mode | output tok/s | vs plain | GPU idle | grammar waits")
    assert len(table) == 2 + len(rows) and table[2].startswith("| plain |")
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_constrained_rows_follow_the_schema(bench):
    """Long enough for rows to close their objects: each that did (finish_reason stop)
    validates against the schema; one cut at max_tokens is a prefix of an object."""
    jsonschema = pytest.importorskip("jsonschema")
    bs = bench[0]
    from graphexec import LLM

    with LLM("tiny", max_batch=8, max_model_len=400, device="cpu") as llm:
        tok = bs.attach_tokenizer(llm, "tiny", detokenize=False)
        row = bs.run_mode(llm, "json_all", [[10 + i, 20, 30] for i in range(8)], 320, 1,
                          tok.decode, warmup=False)
    reasons = row["finish_reasons"]
    assert reasons.count("stop") == row["constrained_finished"] >= 1, row
    done = 0
    for text, reason in zip(row["texts"], reasons):
        assert text.lstrip().startswith("{")
        try:
            obj = json.loads(text, strict=False)
        except ValueError:
            assert reason == "length"  # cut at max_tokens inside the object
            continue
        # a finished row, or one whose object closed on its last allowed token
        jsonschema.validate(obj, bs.SCHEMA)
        done += 1
    assert done == row["constrained_valid"] >= row["constrained_finished"]
