"""PromptCounter: the served model's tokenizer in the gateway, chat template applied."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.body.fields import parse_fields


def test_counts_match_the_tokenizer_with_the_chat_template(tiny_llama_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_dir))
    assert tok is not None
    counter = PromptCounter({"tiny": tok})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = parse_fields(json.dumps({"model": "tiny", "messages": messages}).encode(), "chat")
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert 5 < expected < 100
    assert counter.count("tiny", chat) == expected
    prompt = parse_fields(b'{"model": "tiny", "prompt": "Once upon a time"}', "completion")
    assert counter.count("tiny", prompt) == len(tok("Once upon a time")["input_ids"])
    ids = parse_fields(b'{"model": "tiny", "prompt": [1, 2, 3, 4]}', "completion")
    assert counter.count("tiny", ids) == 4


def test_models_without_a_tokenizer_are_estimated() -> None:
    counter = PromptCounter({})
    fields = parse_fields(b'{"model": "remote", "prompt": "' + b"x" * 400 + b'"}', "completion")
    assert counter.count("remote", fields) == 100
    assert load_tokenizer("/no/such/model") is None


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_tool_definitions_are_counted_in_the_prompt(tiny_llama_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_llama_dir))
    counter = PromptCounter({"tiny": tok})
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = parse_fields(json.dumps({"model": "tiny", "messages": messages}).encode(), "chat")
    body = {"model": "tiny", "messages": messages, "tools": TOOLS}
    with_tools = parse_fields(json.dumps(body).encode(), "chat")
    tool_tokens = len(tok(json.dumps(TOOLS), add_special_tokens=False)["input_ids"])
    assert tool_tokens > 20
    assert counter.count("tiny", with_tools) == counter.count("tiny", plain) + tool_tokens
    estimated = PromptCounter({})
    assert (
        estimated.count("remote", with_tools)
        == (len("Weather in Oslo?") + len(json.dumps(TOOLS))) // 4
    )
