import pytest

from graphexec import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("min_tokens", -1), ("temperature", -0.1),
    ("temperature", float("nan")), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5),
    ("seed", -1), ("stop_token_ids", [-3]), ("stop_token_ids", "x"), ("logprobs", 21),
    ("logprobs", -1), ("ignore_eos", "yes"), ("stop", ""), ("stop", [""]), ("stop", 3),
    ("stop", ["ok", None]), ("stop", [b"x"]), ("include_stop_str_in_output", 1),
    ("skip_special_tokens", "no"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_valid_defaults():
    p = SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=3, logprobs=20)
    assert p.greedy and p.top_k == 5


def test_stop_takes_one_string_or_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams().stop == []


def test_bad_stop_names_the_value():
    with pytest.raises(ValueError, match=r"stop.*\[''\]"):
        SamplingParams(stop=[""])


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -2.01),
    ("frequency_penalty", float("inf")), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")), ("min_p", 1.5), ("min_p", -0.1), ("min_p", True),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}),
    ("logit_bias", {3: 101}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", {3: 1.0, "3": 2.0}),
    ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", 1.0),
])
def test_invalid_penalties_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_penalties_defaults_are_off():
    p = SamplingParams()
    assert not p.uses_penalties
    assert p.repetition_penalty == 1.0 and p.logit_bias is None and p.prompt_logprobs is None
    for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=-1), dict(min_p=0.1),
               dict(repetition_penalty=1.2), dict(logit_bias={5: -100})):
        assert SamplingParams(**kw).uses_penalties, kw


def test_logit_bias_takes_json_keys():
    p = SamplingParams(logit_bias={"17": 5, 3: -2.5}, prompt_logprobs=20)
    assert p.logit_bias == {17: 5.0, 3: -2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams(logit_bias={i: 1 for i in range(300)}).uses_penalties


def test_token_ids_outside_the_vocabulary():
    assert SamplingParams(stop_token_ids=[3]).token_ids_outside(10) is None
    assert SamplingParams(stop_token_ids=[12]).token_ids_outside(10) == ("stop_token_ids", 12)
    assert SamplingParams(logit_bias={9: 1, 10: 1}).token_ids_outside(10) == ("logit_bias", 10)
