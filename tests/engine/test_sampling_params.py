"""SamplingParams: defaults, normalisation, and a ValueError naming the parameter for bad input."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import ParameterError, SamplingParams


def test_defaults_are_valid_and_match_the_contract() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k) == (
        1, 16, 0, 1.0, 1.0, -1,
    )  # fmt: skip
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias == {}
    assert p.logprobs is None and not p.ignore_eos and p.skip_special_tokens
    assert SamplingParams(temperature=0).is_greedy


def test_mutable_defaults_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_stop_string_is_wrapped_and_none_means_empty() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None).stop == []  # type: ignore[arg-type]


def test_logit_bias_accepts_json_string_keys() -> None:
    assert SamplingParams(logit_bias={"50256": -100, 7: 2.5}).logit_bias == {50256: -100.0, 7: 2.5}  # type: ignore[dict-item]


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        logprobs=20,
        prompt_logprobs=0,
        max_tokens=None,
        min_tokens=5,
        seed=123,
    )
    assert p.max_tokens is None and p.min_tokens == 5 and isinstance(p.temperature, float)


BAD = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": "10"}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.1}),
    ("frequency_penalty", {"frequency_penalty": math.nan}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("seed", {"seed": "42"}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": "2"}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": 100}),
    ("logit_bias", {"logit_bias": {"abc": 1}}),
    ("logit_bias", {"logit_bias": {1: 101}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("skip_special_tokens", {"skip_special_tokens": 1}),
]


@pytest.mark.parametrize(("param", "kwargs"), BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_value_raises_value_error_naming_the_parameter(param: str, kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ParameterError)
    assert info.value.param == param
    assert str(info.value).startswith(param)


def test_bool_is_not_an_integer() -> None:
    with pytest.raises(ParameterError, match="^n must"):
        SamplingParams(n=True)
