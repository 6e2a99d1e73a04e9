"""The cheap limits on constraints (engine/structured_output/limits.py): what each refuses, what
it lets through, the 400's wording, and the engine flags that set them."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import EngineConfig
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.limits import (
    ConstraintLimitError,
    ConstraintLimits,
    check_limits,
    check_regex_limits,
    check_tools_limits,
)

LIMITS = ConstraintLimits()


def refusal(spec: StructuredOutputsParams, limits: ConstraintLimits = LIMITS) -> str:
    with pytest.raises(ConstraintLimitError) as info:
        check_limits(spec, limits, "response_format")
    assert info.value.param == "response_format"
    return str(info.value)


@pytest.mark.parametrize(
    "pattern",
    [
        "(a+)+b",  # the classic nested quantifier
        "(a*)*b",
        "((((a+)+)+)+)+b",
        "(\\w+\\s?)+$",  # the separator is optional: not a separator
        "(a|b+)+",  # one alternative has no fixed character
        "(a{0,10}){0,100}b",  # bounded, but still varying inside varying
        "(a+){1,100}b",
        "(?:x(a+)*y)+",
    ],
)
def test_nested_varying_repeats_are_refused(pattern: str) -> None:
    message = refusal(StructuredOutputsParams(regex=pattern))
    assert "nested quantifiers" in message and "--structured-outputs-max-repeat" in message


@pytest.mark.parametrize(
    "pattern",
    ["a{1000}{1000}", "(a{1000}){1000}", "(.{101}){100}", "[a-z]{10001}", "a{3,20000}"],
)
def test_repeat_bounds_and_their_products_over_the_limit_are_refused(pattern: str) -> None:
    message = refusal(StructuredOutputsParams(regex=pattern))
    assert "the limit is 10000 (the server's --structured-outputs-max-repeat)" in message


@pytest.mark.parametrize(
    "pattern",
    [
        "([a-z]+\\.)+[a-z]+",  # the dot separates the copies
        "^[^@]+@([a-z]+\\.)+[a-z]{2,}$",
        "(\\+\\d{1,3})?\\d+",  # an optional group repeats at most once
        "(a+){10}b",  # a fixed count of a varying part
        "(.{100}){100}",  # exactly at the product limit
        "\\d{3}-\\d{4}",
        "[{]+\\{x}",  # braces that are not quantifiers
        "(?:ab+c)*",
        "(\\(|\\))+",  # escaped parentheses are characters
    ],
)
def test_regexes_real_schemas_use_pass(pattern: str) -> None:
    check_regex_limits(pattern, LIMITS, "structured_outputs.regex")


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "flag"),
    [
        ({"type": "string", "description": "x" * 200_000}, "max-bytes"),
        (nested(20), "max-depth"),  # 2 levels of JSON per schema level
        ({"type": "object", "properties": {f"p{i}": {} for i in range(5001)}}, "max-properties"),
        ({"enum": list(range(1001))}, "max-enum-values"),
        ({"type": "string", "maxLength": 10**6}, "max-repeat"),
        ({"type": "array", "minItems": 20_000}, "max-repeat"),
        ({"type": "string", "pattern": "(a+)+"}, "max-repeat"),
        ({"anyOf": [{"type": "integer"}] * 30_000}, "max-nodes"),  # 60k values, ~0.5 MB
    ],
)
def test_schemas_over_a_limit_are_refused_naming_it(schema: dict[str, Any], flag: str) -> None:
    # The byte limit raised for the node count only: its schema would be refused for size.
    limits = ConstraintLimits(max_bytes=10**7) if flag == "max-nodes" else LIMITS
    message = refusal(StructuredOutputsParams(json=schema), limits)
    assert f"--structured-outputs-{flag})" in message


def test_a_deep_schema_beyond_pythons_stack_is_refused_not_crashed() -> None:
    deep: Any = {}
    for _ in range(100_000):
        deep = {"items": deep}
    assert "max-depth" in refusal(StructuredOutputsParams(json=deep))


def test_grammars_and_choices_have_limits_too() -> None:
    assert "max-bytes" in refusal(StructuredOutputsParams(grammar='root ::= "' + "a" * 200_000))
    assert "max-enum-values" in refusal(StructuredOutputsParams(choice=["x"] * 1001))


def test_tool_count_and_size_are_limited() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    check_tools_limits([tool] * 128, LIMITS)
    with pytest.raises(ConstraintLimitError, match="129 tools; the limit is 128") as info:
        check_tools_limits([tool] * 129, LIMITS)
    assert info.value.param == "tools"
    big = {"type": "function", "function": {"name": "f", "description": "x" * 600_000}}
    with pytest.raises(ConstraintLimitError, match="--structured-outputs-max-tools-bytes"):
        check_tools_limits([big], LIMITS)


def test_the_limits_are_engine_flags_validated_at_construction() -> None:
    config = EngineConfig(structured_outputs_max_repeat=50, structured_outputs_compile_timeout=2.5)
    assert config.constraint_limits.max_repeat == 50
    assert config.constraint_limits.compile_timeout == 2.5
    with pytest.raises(ValueError, match="--structured-outputs-max-depth"):
        EngineConfig(structured_outputs_max_depth=0)
    with pytest.raises(ValueError, match="--structured-outputs-compile-timeout"):
        EngineConfig(structured_outputs_compile_timeout=0.0)
    with pytest.raises(ValueError, match="--structured-outputs-max-mask-ms"):
        EngineConfig(structured_outputs_max_mask_ms=-1.0)
