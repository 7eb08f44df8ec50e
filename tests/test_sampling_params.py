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
