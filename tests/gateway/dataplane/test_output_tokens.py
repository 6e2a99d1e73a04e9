"""Output counted by the gateway when a provider reports no usage (output_tokens.py)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from gateway.relay.output_tokens import OutputCounter


def _event(delta: dict[str, object]) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"


def test_estimate_is_four_characters_per_token_rounded_up() -> None:
    counter = OutputCounter(None)
    assert counter.source == "estimate"
    assert counter.count_text("") == 0
    assert counter.count_text("abcd") == 1
    assert counter.count_text("abcde") == 2


def test_stream_counts_content_reasoning_and_tool_calls_but_not_roles() -> None:
    call = {"index": 0, "function": {"name": "get", "arguments": '{"a":1}'}}
    blocks = [
        _event({"role": "assistant", "content": ""}) + _event({"content": "abcd"}),
        _event({"reasoning_content": "efgh"}),
        _event({"tool_calls": [call]}) + b'data: {"choices":[],"usage":null}\n\n',
        b"data: [DONE]\n\n",
    ]
    # "abcd" + "efgh" + "get" + '{"a":1}' = 18 characters -> 5 tokens
    assert OutputCounter(None).count_stream(blocks) == 5


def test_body_counts_every_choice_and_survives_garbage() -> None:
    body = {"choices": [{"message": {"content": "abcdefgh"}}, {"text": "abcd"}]}
    counter = OutputCounter(None)
    assert counter.count_body(json.dumps(body).encode()) == 3
    assert counter.count_body(b"not json") == 0
    assert counter.count_stream([b"data: {oops\n\n", b": comment\n\n"]) == 0


def test_tokenizer_counts_what_the_model_would(tiny_llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    counter = OutputCounter(tok)
    assert counter.source == "tokenizer"
    text = " tok tok tok and more words"
    assert counter.count_stream([_event({"content": text})]) == len(
        tok.encode(text, add_special_tokens=False)
    )
