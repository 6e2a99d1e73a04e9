"""Tool calling through the gateway: a real ``portico serve`` supervising a real tiny engine
(started with the Hermes parser), real Redis, the real ``openai`` client with a tenant's key.

The gateway must pass tools, tool_choice, tool turns and the engine's tool-call replies (whole
and streamed) through unchanged, and its errors must keep naming the engine's parameter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}
PICK = {
    "type": "function",
    "function": {
        "name": "pick_color",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
    },
}
FLIP = {
    "type": "function",
    "function": {
        "name": "flip",
        "parameters": {
            "type": "object",
            "properties": {"heads": {"type": "boolean"}},
            "required": ["heads"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [PICK, FLIP]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Pick a color."}]


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    engine = tiny_engine(tiny_llama_dir, "tiny")
    engine["args"] += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    gw = GatewayProcess(
        module_tmp, {"redis": {"url": redis_server.url}, "engines": [engine]}, ROUTING
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> openai.OpenAI:
    key = gateway.create_tenant("standard")[1]
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_required_tool_calls_pass_through_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=11,
        max_tokens=60,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    pieces: dict[str, str] = {"name": "", "arguments": ""}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                pieces["name"] += delta.function.name or ""
                pieces["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert (pieces["name"], pieces["arguments"]) == (call.function.name, call.function.arguments)


def test_tool_turns_and_tool_errors_pass_through(client: openai.OpenAI) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "pick_color", "arguments": '{"color": "red"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    resp = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert resp.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    assert info.value.body["param"] == "tool_choice"
