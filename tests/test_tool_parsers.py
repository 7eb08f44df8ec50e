"""tool_choice "auto": the hermes and llama3_json parsers on hand-written model outputs (the
malformed ones included), their streaming against the whole-text parse at every cut, the
request checks, and the server end to end with the openai client: a tiny random-weight model
with a byte-level tokenizer and a chat template that renders tools, its output made a call by
a structured_outputs regex (auto leaves it free otherwise)."""
from __future__ import annotations

import json
import random

import pytest

from graphexec.serve.tool_parsers import (PARSERS, CallArguments, Parsed, ParsedCall, collect,
                                         parse)

WEATHER = '{"city": "Paris", "unit": "celsius"}'


def _calls(*pairs: tuple[str, str]) -> list[ParsedCall]:
    return [ParsedCall(n, a) for n, a in pairs]


HERMES = [
    # (model output, content, calls)
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "", _calls(("get_weather", WEATHER))),
    (f'Let me check.\n\n<tool_call>{{"name": "get_weather", "arguments": {WEATHER}}}'
     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
     "Let me check.", _calls(("get_weather", WEATHER), ("get_time", '{"zone": "UTC"}'))),
    # text after a call, braces and the closing tag inside argument strings, escapes in names
    ('<tool_call>{"name": "say", "arguments": {"text": "} </tool_call> \\" {"}}</tool_call>'
     ' Done.', " Done.", _calls(("say", '{"text": "} </tool_call> \\" {"}'))),
    ('<tool_call>{"name": "caf\\u00e9", "arguments": {}}</tool_call>', "",
     _calls(("café", "{}"))),
    # "parameters" for "arguments", and the keys in another order: read whole
    ('<tool_call>{"name": "f", "parameters": {"a": [1, 2]}}</tool_call>', "",
     _calls(("f", '{"a": [1, 2]}'))),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", _calls(("f", '{"a": 1}'))),
    # a block left unclosed before the next one, and at the end
    ('<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g", "arguments": {}}', "",
     _calls(("f", "{}"), ("g", "{}"))),
    # cut by max_tokens inside the arguments: the call stands with what was written
    ('<tool_call>{"name": "f", "arguments": {"a": "unfini', "", _calls(("f", '{"a": "unfini'))),
    # malformed: not a call, so content, character for character
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"</tool_call>',
     '<tool_call>{"arguments": {"a": 1}, "name": "f"</tool_call>', []),
    ('a <tool_call>{"name": "f", "argu', 'a <tool_call>{"name": "f", "argu', []),
    ("x < y and <tool_ca", "x < y and <tool_ca", []),
    ("no calls here\n", "no calls here\n", []),
    ("", "", []),
]

LLAMA3 = [
    (f'{{"name": "get_weather", "parameters": {WEATHER}}}', "",
     _calls(("get_weather", WEATHER))),
    (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}', "",
     _calls(("get_weather", WEATHER))),
    (f' {{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", '
     '"parameters": {"zone": "a;b"}}', "",
     _calls(("get_weather", WEATHER), ("get_time", '{"zone": "a;b"}'))),
    ('{"name": "f", "arguments": {}}', "", _calls(("f", "{}"))),
    ('{"parameters": {"x": null}, "name": "f"}', "", _calls(("f", '{"x": null}'))),
    ('{"name": "f", "parameters": {}} and some words', "and some words", _calls(("f", "{}"))),
    ('{"name": "f", "parameters": {"x": [tru', "", _calls(("f", '{"x": [tru'))),
    # not calls: prose, JSON of another shape, JSON later in the text, a broken object
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "Alice", "age": 3}', '{"name": "Alice", "age": 3}', []),
    ('Here: {"name": "f", "parameters": {}}', 'Here: {"name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": }', '{"name": "f", "parameters": }', []),
    ('  {"name": "f"', '  {"name": "f"', []),
    ("<|python_ta", "<|python_ta", []),
]

SAMPLES = [("hermes", *s) for s in HERMES] + [("llama3_json", *s) for s in LLAMA3]


@pytest.mark.parametrize("fmt,text,content,calls", SAMPLES)
def test_whole_output(fmt, text, content, calls):
    assert parse(fmt, text) == Parsed(content, calls)


@pytest.mark.parametrize("fmt,text,content,calls", SAMPLES)
def test_streamed_at_every_cut_equals_the_whole_parse(fmt, text, content, calls):
    whole = Parsed(content, calls)
    for cut in range(len(text) + 1):
        p = PARSERS[fmt]()
        assert collect(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()) == whole, cut
    p = PARSERS[fmt]()
    events = [ev for ch in text for ev in p.feed(ch)] + p.finish()
    assert collect(events) == whole
    rng = random.Random(len(text))
    for _ in range(20):  # three and more pieces
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        p = PARSERS[fmt]()
        events = [ev for a, b in zip([0] + cuts, cuts + [len(text)]) for ev in p.feed(text[a:b])]
        assert collect(events + p.finish()) == whole, cuts


def test_content_before_a_call_streams_and_the_call_waits_for_its_header():
    p = PARSERS["hermes"]()
    assert collect(p.feed("Sure, one moment. <tool_")).content == "Sure, one moment."
    assert p.feed('call>{"name": "get_ti') == []  # may still be a call: held
    started = collect(p.feed('me", "arguments": {"zone": "U'))
    assert started.calls == _calls(("get_time", '{"zone": "U'))
    assert p.feed('TC"}}</tool_call>') + p.finish() == [CallArguments(0, 'TC"}')]  # the rest


def test_text_that_only_looked_like_a_call_goes_out_once_decided():
    p = PARSERS["llama3_json"]()
    assert p.feed("   ") == [] and p.feed("{") == []
    assert collect(p.feed('"city": "Paris"}')).content == '   {"city": "Paris"}'


# -- the request side: refusals, messages, stream deltas -----------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
            "additionalProperties": False}}}]
RENDERS_TOOLS = ("{% if tools %}[TOOLS]{% for t in tools %}{{ t.function.name }} {% endfor %}"
                 "[/TOOLS]{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
NO_TOOLS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_auto_is_refused_without_a_parser_or_a_template_that_renders_tools():
    from graphexec.serve.errors import APIError
    from graphexec.serve.tools import auto_tools

    with pytest.raises(APIError, match="--tool-call-parser") as e:
        auto_tools(TOOLS, "auto", None, RENDERS_TOOLS)
    assert e.value.param == "tool_choice" and e.value.status == 400
    with pytest.raises(APIError, match="does not render tools") as e:
        auto_tools(TOOLS, None, "hermes", NO_TOOLS)
    assert e.value.param == "tool_choice"
    assert auto_tools(TOOLS, None, "hermes", RENDERS_TOOLS).parser == "hermes"
    assert auto_tools(TOOLS, "none", "hermes", RENDERS_TOOLS) is None
    assert auto_tools(None, "auto", None, NO_TOOLS) is None  # no tools: plain text


@pytest.mark.parametrize("tools,choice,param,shown", [
    ([{"type": "function"}], "auto", "tools", '{"type": "function"}'),
    ([{"function": {"name": "f", "parameters": 3}}], "auto", "tools", "got 3"),
    (TOOLS, "sometimes", "tool_choice", '"sometimes"'),
])
def test_bad_tools_name_the_field_and_value(tools, choice, param, shown):
    from graphexec.serve.errors import APIError
    from graphexec.serve.tools import tool_mode

    with pytest.raises(APIError) as e:
        tool_mode(tools, choice)
    assert e.value.param == param and shown in e.value.message, e.value.message


def test_message_and_finish_reason():
    from graphexec.serve.tools import AutoTools

    auto = AutoTools("hermes")
    msg, finish = auto.message('Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
    assert finish == "tool_calls" and msg["content"] == "Hi"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": "{}"}
    msg, finish = auto.message('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "stop")
    assert msg["content"] is None
    assert auto.message("plain", "stop") == ({"role": "assistant", "content": "plain"}, "stop")
    assert auto.message('<tool_call>{"name": "f", "arguments": {"a', "length")[1] == "length"


def test_stream_deltas_take_openai_shape():
    from graphexec.serve.chat_completions import _CallDeltas

    text = ('Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": '
            '"celsius"}}</tool_call>')
    s = _CallDeltas(PARSERS["hermes"]())
    deltas = [d for i, ch in enumerate(text) for d in s.feed(ch, i == len(text) - 1)]
    content = "".join(d.get("content", "") for d in deltas)
    parts = [tc for d in deltas for tc in d.get("tool_calls", [])]
    firsts = [p for p in parts if "id" in p]
    assert content == "Checking." and s.calls == 2
    assert [(p["index"], p["type"], p["function"]) for p in firsts] == [
        (0, "function", {"name": "get_time", "arguments": ""}),
        (1, "function", {"name": "get_weather", "arguments": ""})]
    for p in parts:  # every part names its call; only a call's first carries id and name
        assert set(p) == ({"index", "id", "type", "function"} if p in firsts
                          else {"index", "function"})
    args = ["".join(p["function"]["arguments"] for p in parts if p["index"] == i)
            for i in (0, 1)]
    assert args == ['{"zone": "UTC"}', '{"city": "Oslo", "unit": "celsius"}']
    assert parts.index(firsts[1]) > max(i for i, p in enumerate(parts) if p["index"] == 0)


def test_parser_flag_and_config_refuse_unknown_names():
    from graphexec.serve.__main__ import parse_args
    from graphexec.serve.config import ServeConfig

    assert parse_args(["--model", "m", "--tool-call-parser", "hermes"]).tool_call_parser == \
        "hermes"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="tool_call_parser.*'mistral'"):
        ServeConfig(model="m", served_model_name="m", tool_call_parser="mistral")


# -- end to end: a server with --tool-call-parser, driven by the openai client ------------

ASK = [{"role": "user", "content": "What is the weather in Oslo, and the time in UTC?"}]
# What the model is made to write (auto leaves the output free, so a regex can shape it): text,
# then two calls whose arguments it chooses within the tools' schemas.
FORCED = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
          r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>\n<tool_call>\{"name": "get_time", '
          r'"arguments": \{"zone": "[A-Z]{3}"\}\}</tool_call>')
RENDERED = "[TOOLS]get_weather get_time [/TOOLS]"  # what RENDERS_TOOLS adds for TOOLS


def _tiny_chat_model(path) -> str:
    """A random-weight Llama whose tokenizer spells every byte as a token (so a prompt's length
    in tokens is its length in bytes) and whose chat template renders tools."""
    from conftest import make_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    make_hf_model(str(path), "llama")
    specials = ["<pad>", "<s>", "</s>"]  # eos is id 2, as the model's config says
    vocab = {t: i for i, t in enumerate(specials + pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": RENDERS_TOOLS, "bos_token": "<s>", "eos_token": "</s>"}))
    return str(path)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from test_server import KEY, Server, openai

    path = _tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    srv = Server(path, "--api-key", KEY, "--served-model-name", "tiny-chat", "--max-batch", "4",
                 "--max-model-len", "512", "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


def _ask(client, regex: str = FORCED, **extra):
    return client.chat.completions.create(
        model="tiny-chat", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}}, **extra)


def _check_calls(calls: list[tuple[str, str]]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_auto_answers_tool_calls_with_the_tools_rendered(client):
    plain = client.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=1)
    out = _ask(client)
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens + len(RENDERED)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content == "Checking."
    calls = c.message.tool_calls
    assert all(tc.type == "function" and tc.id.startswith("call_") for tc in calls)
    assert len({tc.id for tc in calls}) == 2
    _check_calls([(tc.function.name, tc.function.arguments) for tc in calls])


def test_auto_streams_tool_call_deltas(client):
    chunks = [ch for ch in _ask(client, stream=True) if ch.choices]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(d.content or "" for d in deltas) == "Checking."
    parts = [tc for d in deltas for tc in (d.tool_calls or [])]
    calls: dict[int, list] = {}
    for p in parts:
        if p.index not in calls:  # a call's first delta: id, type, name, no arguments yet
            assert p.id and p.type == "function" and p.function.name
            assert p.function.arguments == ""
            calls[p.index] = [p.function.name, ""]
        else:
            assert p.id is None and p.function.name is None
            calls[p.index][1] += p.function.arguments
    assert sorted(calls) == [0, 1]
    assert len([p for p in parts if p.index == 0]) > 2  # the arguments came in pieces
    _check_calls([tuple(calls[i]) for i in (0, 1)])


def test_none_renders_the_tools_and_reads_no_calls(client):
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    out = _ask(client, call, tool_choice="none")
    c = out.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content == call.replace("\\", "")  # the call, left as text
    plain = client.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=1)
    assert out.usage.prompt_tokens == plain.usage.prompt_tokens + len(RENDERED)
    # and without a call in the output, auto answers plain content
    c = _ask(client, "It is sunny[.!]").choices[0]
    assert c.message.content in ("It is sunny.", "It is sunny!") and not c.message.tool_calls
    assert c.finish_reason == "stop"
