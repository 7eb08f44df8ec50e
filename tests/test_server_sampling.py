"""The server's sampling controls: presence, frequency and repetition penalties, logit_bias and
min_p reach the engine (the same tokens as LLM.generate with the same SamplingParams), echo
with logprobs and prompt_logprobs on completions, and every bad value a 400 naming its field."""
from __future__ import annotations

import pytest

from test_server import KEY, MODEL, Server, _ids, httpx, openai
from test_tool_parsers import TOOLS

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server():
    srv = Server(MODEL, "--api-key", KEY, "--max-batch", "4", "--max-model-len", "256",
                 "--num-kv-blocks", "64")
    yield srv
    assert srv.stop() == 0, srv.output()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_penalties_reach_the_engine(server):
    from graphexec import LLM, SamplingParams

    extra = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.1)
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, return_token_ids=True, **extra)
    got = _post(server, "/v1/completions", body)["choices"][0]["token_ids"]
    plain = _post(server, "/v1/completions", {**body, **dict(
        presence_penalty=0, frequency_penalty=0, repetition_penalty=1, min_p=0)})
    llm = LLM(MODEL, device="cpu", max_model_len=256, num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, **extra))[0]
    assert got == want.token_ids
    assert got != plain["choices"][0]["token_ids"]


def test_logit_bias_forces_a_token(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [42] * 5


def test_echo_with_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    echo=True, logprobs=2)
    c = out.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 and t for t in lp.top_logprobs[1:]), lp.top_logprobs
    assert lp.text_offset == sorted(lp.text_offset)
    # streamed: the prompt comes first, once
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, echo=True, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    # echo without logprobs asks for no prompt logprobs
    plain = _post(server, "/v1/completions", dict(prompt=[PROMPT, "Hi"], max_tokens=2,
                                                  temperature=0, echo=True))
    assert [ch["text"][:len(p)] for ch, p in zip(plain["choices"], [PROMPT, "Hi"])] == [
        PROMPT, "Hi"]


def test_prompt_logprobs_extension(server):
    from graphexec import LLM, SamplingParams

    got = _post(server, "/v1/completions", dict(prompt=PROMPT, max_tokens=1, temperature=0,
                                                prompt_logprobs=1))["choices"][0]
    llm = LLM(MODEL, device="cpu", max_model_len=256, num_kv_blocks=64)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    lps = got["prompt_logprobs"]
    assert len(lps) == len(want.prompt_token_ids) and lps[0] is None
    for mine, ref in zip(lps[1:], want.prompt_logprobs[1:]):
        assert mine[str(ref.token_id)]["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
        assert len(mine) <= 2
    chat = _post(server, "/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=1, prompt_logprobs=0))
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3


BAD = {
    "presence_penalty": {"presence_penalty": 2.5},
    "frequency_penalty": {"frequency_penalty": -3},
    "logit_bias": {"logit_bias": {"x": 1}},
    "logit_bias value": {"logit_bias": {"5": 500}},
    "logit_bias entries": {"logit_bias": {str(i): 1 for i in range(301)}},
    "logit_bias id outside the vocabulary": {"logit_bias": {str(10**8): 1}},
    "repetition_penalty": {"extra_body": {"repetition_penalty": 0}},
    "min_p": {"extra_body": {"min_p": 1.5}},
    "prompt_logprobs": {"extra_body": {"prompt_logprobs": 21}},
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_400_naming_the_field(client, case):
    param = case.split()[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=_ids(4), max_tokens=2, **BAD[case])
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param in err["message"] and "cmpl-" not in err["message"], err
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, **BAD[case])
    assert e.value.body["param"] == param, e.value.body


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}


def test_response_format_json_schema(client):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    msgs = [{"role": "user", "content": "Give me a city and its population as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100,
                                         temperature=0, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100,
                                            temperature=0, response_format=fmt, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == out.choices[0].message.content
    obj = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=100, seed=1,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_structured_outputs_extension(client):
    import re

    pytest.importorskip("xgrammar")
    out = client.completions.create(model=MODEL, prompt="A product code:", max_tokens=20,
                                    temperature=1.0, seed=3, extra_body={
                                        "structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("change,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"json": {}, "regex": "x"}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"pattern": "x"}}}, "structured_outputs"),
])
def test_bad_structured_outputs_are_400(client, change, param):
    pytest.importorskip("xgrammar")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, **change)
    assert e.value.body["param"] == param, e.value.body
    assert "cmpl-" not in e.value.body["message"], e.value.body


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call) -> None:
    import json

    jsonschema = pytest.importorskip("jsonschema")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])


def test_tool_choice_required_and_named(client):
    pytest.importorskip("xgrammar")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", max_tokens=80, temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    _check_call(c.message.tool_calls[0])
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice=named, max_tokens=80, temperature=0)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time"
    _check_call(call)
    # streamed: the named call's id and name first, then its arguments as deltas
    for choice in ("required", named):
        chunks = [ch for ch in client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
            temperature=0, stream=True) if ch.choices]
        parts = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert parts and parts[0].id and parts[0].function.name
        args = "".join(p.function.arguments or "" for p in parts)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        _check_call(type(parts[0])(index=0, id=parts[0].id, type="function", function={
            "name": parts[0].function.name, "arguments": args}))


@pytest.mark.parametrize("change,param", [
    ({"tools": TOOLS}, "tool_choice"),  # "auto", the default: no --tool-call-parser here
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400(client, change, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **change)
    assert e.value.body["param"] == param, e.value.body


def test_streamed_required_call_is_held_until_complete():
    """With "required" the call's name is inside its JSON: nothing goes out until the output is
    complete, and an output cut by max_tokens goes out as text."""
    from graphexec.serve.chat_completions import _StreamedCalls
    from graphexec.serve.tools import tool_mode

    mode = tool_mode(TOOLS, "required")
    s = _StreamedCalls(mode, 2)
    assert s.delta(0, '{"name": "get_time", ', None) == ({}, None)
    delta, finish = s.delta(0, '"arguments": {"zone": "UTC"}}', "stop")
    assert finish == "tool_calls"
    assert delta["tool_calls"][0]["function"] == {"name": "get_time",
                                                  "arguments": '{"zone": "UTC"}'}
    assert s.delta(1, '{"name": "get_ti', "length") == ({"content": '{"name": "get_ti'},
                                                        "length")
