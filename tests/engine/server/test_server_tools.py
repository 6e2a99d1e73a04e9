"""Tool calling against real `portico engine` processes, with the real `openai` and `litellm`.

The tiny model (random weights) proves the plumbing: validation, history with tool turns, the
Hermes parser reading a reply the grammar spelled out. The default model (SmolLM2) proves the
promise users rely on: with ``tool_choice="required"`` or a named function, every call names an
offered function and its arguments validate against that function's schema, and the streamed
deltas reassemble to exactly the non-streamed call for the same seed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

HERMES = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm.",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "label": {"type": "string", "maxLength": 12},
                },
                "required": ["hour"],
                "additionalProperties": False,
            },
        },
    },
]
UNENFORCEABLE = {
    "type": "function",
    "function": {
        "name": "broken",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What's the weather like in Paris today?",
    "What is 17 plus 25?",
    "Wake me up at 7 tomorrow.",
    "Is it raining in Tokyo?",
    "Please add 300 and -12.",
]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "What's the weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": -3}'},
]


def assert_valid_calls(message: Any, offered: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in offered
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(stream: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    """Put streamed tool-call deltas back together the way the SDKs' helpers do."""
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
            if delta.id:
                assert not entry["id"], "a call's id is sent once"
                entry["id"] = delta.id
            if delta.function and delta.function.name:
                assert not entry["name"], "a call's name is sent once"
                entry["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
        finish = choice.finish_reason or finish
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish, content


def serve_with_hermes(
    model: Path, logs: Path, max_model_len: int, kv_cache: str
) -> Iterator[EngineProcess]:
    """A real engine with the Hermes parser and auto tool choice, stopped cleanly after."""
    extra = [*HERMES, "--max-model-len", str(max_model_len), "--kv-cache-memory", kv_cache]
    server = EngineProcess(model, logs / "engine.log", extra=extra)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.logs()


def client_of(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


# ---------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny_tools_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("engine-tools-logs")
    yield from serve_with_hermes(tiny_llama_dir, logs, 1024, "32MiB")


@pytest.fixture(scope="module")
def tiny(tiny_tools_server: EngineProcess) -> openai.OpenAI:
    return client_of(tiny_tools_server)


def test_tool_turns_in_the_history_are_accepted_and_rendered(tiny: openai.OpenAI) -> None:
    plain = tiny.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[:1], max_tokens=2, tool_choice="none", tools=TOOLS
    )
    with_turns = tiny.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, max_tokens=2, tool_choice="none", tools=TOOLS
    )
    assert with_turns.choices[0].message.tool_calls is None
    assert with_turns.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_choice_none_hides_the_tools(tiny: openai.OpenAI) -> None:
    without = tiny.chat.completions.create(model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1)
    hidden = tiny.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1, tools=TOOLS, tool_choice="none"
    )
    shown = tiny.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY[:1], max_tokens=1, tools=TOOLS, tool_choice="auto"
    )
    assert hidden.usage.prompt_tokens == without.usage.prompt_tokens
    assert shown.usage.prompt_tokens > without.usage.prompt_tokens + 100  # the tool listing


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [UNENFORCEABLE], "tool_choice": "required"}, "tools"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(
    tiny: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"tools": TOOLS, **change}
    with pytest.raises(openai.BadRequestError) as info:
        tiny.chat.completions.create(model=MODEL_NAME, messages=HISTORY[:1], **body)
    assert info.value.body["param"] == param
    assert info.value.body["type"] == "invalid_request_error"


def test_auto_with_the_hermes_parser_extracts_calls_from_the_text(tiny: openai.OpenAI) -> None:
    # The grammar spells the reply out (the random model could not), so the parser has text
    # with content and two Hermes blocks to read, and the stream must agree with it.
    reply = (
        'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7}}\n</tool_call>'
    )
    spelled = {"structured_outputs": {"choice": [reply]}}
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, messages=HISTORY[:1], tools=TOOLS, max_tokens=120, extra_body=spelled
    )
    resp = tiny.chat.completions.create(**kwargs)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("add", {"a": 2, "b": 3}),
        ("set_alarm", {"hour": 7}),
    ]
    calls, finish, content = reassemble(tiny.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == "Checking."
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]


# ---------------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def smollm2_server(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("engine-smollm2-tools-logs")
    yield from serve_with_hermes(smollm2_gguf, logs, 2048, "64MiB")


@pytest.fixture(scope="module")
def smol(smollm2_server: EngineProcess) -> openai.OpenAI:
    return client_of(smollm2_server)


OFFERED = {t["function"]["name"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(len(PROMPTS)))
def test_required_always_calls_an_offered_function_with_valid_arguments(
    smol: openai.OpenAI, seed: int
) -> None:
    resp = smol.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[seed]}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=seed,
        max_tokens=200,
    )
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.choices[0].message.content is None
    assert len(resp.choices[0].message.tool_calls) == 1
    assert_valid_calls(resp.choices[0].message, OFFERED)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(len(PROMPTS)))
def test_parallel_required_calls_validate_up_to_a_cut(smol: openai.OpenAI, seed: int) -> None:
    # With parallel calls the small model may go on adding calls until max_tokens: then the
    # reply says "length" and only its last call may be unfinished; every other one validates.
    resp = smol.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[seed]}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0.8,
        seed=seed,
        max_tokens=120,
    )
    choice = resp.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls or []
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert calls and all(c.function.name in OFFERED for c in calls)
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(len(PROMPTS)))
def test_a_named_function_is_the_one_called_with_valid_arguments(
    smol: openai.OpenAI, seed: int
) -> None:
    resp = smol.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[seed]}],
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0.8,
        seed=seed,
        max_tokens=200,
    )
    assert resp.choices[0].finish_reason == "tool_calls"
    assert len(resp.choices[0].message.tool_calls) == 1
    assert_valid_calls(resp.choices[0].message, {"add"})


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_deltas_reassemble_to_the_non_streamed_call(
    smol: openai.OpenAI, tool_choice: Any
) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0.8,
        seed=1234,
        max_tokens=200,
    )
    whole = smol.chat.completions.create(**kwargs).choices[0]
    calls, finish, content = reassemble(smol.chat.completions.create(stream=True, **kwargs))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason and content == ""
    assert calls, "the grammar forces at least one call"


@pytest.mark.slow
def test_the_sdks_stream_helper_reassembles_the_same_calls(smol: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": PROMPTS[3]}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # the SDK helpers refuse a reply cut by max_tokens
        temperature=0.8,
        seed=99,
        max_tokens=200,
    )
    whole = smol.chat.completions.create(**kwargs).choices[0]
    with smol.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class Add(pydantic.BaseModel):
    a: int = pydantic.Field(ge=-1000, le=1000)
    b: int = pydantic.Field(ge=-1000, le=1000)


@pytest.mark.slow
def test_parse_with_pydantic_function_tools_gives_parsed_arguments(smol: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
    for seed, prompt in enumerate(PROMPTS):
        resp = smol.chat.completions.parse(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": prompt}],
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,  # the SDK helpers refuse a reply cut by max_tokens
            temperature=0.8,
            seed=seed,
            max_tokens=200,
        )
        calls = resp.choices[0].message.tool_calls
        assert calls
        for call in calls:
            assert isinstance(call.function.parsed_arguments, (GetWeather, Add))


@pytest.mark.slow
def test_a_tool_result_in_the_history_leads_to_an_answer(smol: openai.OpenAI) -> None:
    resp = smol.chat.completions.create(
        model=MODEL_NAME, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=40
    )
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


@pytest.mark.slow
def test_litellm_gets_the_same_tool_calls(
    smol: openai.OpenAI, smollm2_server: EngineProcess
) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    kwargs: dict[str, Any] = dict(
        messages=[{"role": "user", "content": PROMPTS[1]}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=7,
        max_tokens=200,
    )
    direct = smol.chat.completions.create(model=MODEL_NAME, **kwargs).choices[0].message
    via = litellm.completion(
        model=f"openai/{MODEL_NAME}",
        api_base=smollm2_server.base_url + "/v1",
        api_key=smollm2_server.api_key,
        **kwargs,
    )
    message = via.choices[0].message
    assert via.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in direct.tool_calls
    ]
