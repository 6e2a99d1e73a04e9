"""What tools and tool_choice mean: the plan, the grammar's schema, the rendered prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.server.protocol import parse_body
from engine.server.protocol_chat import CHAT_UNSUPPORTED, ChatCompletionRequest
from engine.server.tool_calling import (
    plan_tools,
    render_messages,
    template_supports_tools,
)
from engine.server.tool_parsers import HermesToolParser, JsonToolCallParser
from portico.errors import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NOW]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode(), CHAT_UNSUPPORTED)


def test_required_lets_the_grammar_pick_any_offered_function_with_valid_arguments() -> None:
    plan = plan_tools(chat(tools=TOOLS, tool_choice="required"), None, False)
    assert isinstance(plan.parser, JsonToolCallParser)
    schema = plan.schema
    assert schema is not None
    good = [
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "add", "arguments": {"a": 1}}],
        [{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}],
        [{"name": "delete_all", "arguments": {}}],
        [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_without_parallel_calls_is_one_call() -> None:
    schema = plan_tools(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None, False
    ).schema
    assert schema is not None
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "arguments": {}}], schema)


def test_a_named_choice_fixes_the_function() -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    plan = plan_tools(chat(tools=TOOLS, tool_choice=choice), None, False)
    assert plan.schema is not None
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, plan.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "now", "arguments": {}}, plan.schema)


def test_auto_needs_the_servers_parser_and_then_constrains_nothing() -> None:
    with pytest.raises(InvalidRequestError) as info:
        plan_tools(chat(tools=TOOLS), "hermes", False)
    assert info.value.param == "tool_choice"
    plan = plan_tools(chat(tools=TOOLS), "hermes", True)
    assert isinstance(plan.parser, HermesToolParser) and plan.schema is None


def test_auto_without_parallel_calls_keeps_the_first_call() -> None:
    plan = plan_tools(chat(tools=TOOLS, parallel_tool_calls=False), "hermes", True)
    assert plan.parser is not None
    text = '<tool_call>{"name": "now", "arguments": {}}</tool_call>' * 2
    assert [c.name for c in plan.parser.parse(text, final=True).calls] == ["now"]


def test_none_shows_no_tools_and_parses_nothing() -> None:
    plan = plan_tools(chat(tools=TOOLS, tool_choice="none"), "hermes", True)
    assert plan.tools == [] and plan.parser is None and plan.schema is None


def test_the_default_template_lists_tools_and_replays_calls_and_results() -> None:
    req = chat(
        tools=TOOLS,
        tool_choice="required",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
        ],
    )
    plan = plan_tools(req, None, False)
    conversation, tools = render_messages(req.messages, plan, native=False)
    assert tools is None
    system = conversation[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    listed = system["content"].split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["function"]["name"] for line in listed] == [
        "get_weather",
        "add",
        "now",
    ]
    assert conversation[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>",
    }
    assert conversation[3] == {
        "role": "user",
        "content": "<tool_response>\n-3 C, snow\n</tool_response>",
    }


def test_a_template_that_reads_tools_gets_them_natively(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert not template_supports_tools(tokenizer.chat_template)  # SmolLM2's template
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}; {% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}; {% endfor %}"
    )
    assert template_supports_tools(tokenizer.chat_template)
    req = chat(
        tools=TOOLS,
        tool_choice="required",
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "snow"},
        ],
    )
    conversation, tools = render_messages(req.messages, plan_tools(req, None, False), native=True)
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert text == (
        "TOOL get_weather; TOOL add; TOOL now; "
        "user: Weather?; assistant: CALL get_weather Oslo; tool: snow; "
    )
