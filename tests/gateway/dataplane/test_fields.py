"""Request fields: one parse, 400 in OpenAI's shape for bad input, body edits for the engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.body.fields import parse_fields
from gateway.relay.usage_relay import Usage, _take_usage, upstream_body
from portico.errors import InvalidRequestError

ONE_TURN = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": ["x"]}', "messages[0]"),
        (ONE_TURN + b'"stream": "yes"}', "stream"),
        (ONE_TURN + b'"max_tokens": -1}', "max_tokens"),
        (ONE_TURN + b'"max_tokens": "9"}', "max_tokens"),
        (ONE_TURN + b'"tools": {}}', "tools"),
        (ONE_TURN + b'"stream_options": 3}', "stream_options"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_parameter(raw: bytes, param: str | None) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        parse_fields(raw, "chat")
    assert exc.value.status_code == 400
    assert exc.value.param == param


def test_completion_needs_a_prompt() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        parse_fields(b'{"model": "m"}', "completion")
    assert exc.value.param == "prompt"
    f = parse_fields(b'{"model": "m", "prompt": "hi", "max_tokens": 4}', "completion")
    assert (f.prompt, f.max_tokens, f.stream) == ("hi", 4, False)


def test_fast_path_splices_salt_and_usage_request_without_reserializing() -> None:
    raw = b'{"model": "m", "stream": true,  "messages": [{"role": "user", "content": "x"}]}  '
    f = parse_fields(raw, "chat")
    out = upstream_body(raw, f, "m", "salt-1")
    assert out.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    body = json.loads(out)
    assert body["cache_salt"] == "salt-1"
    assert body["stream_options"] == {"include_usage": True}
    assert not f.wants_usage


def test_non_stream_without_salt_forwards_the_original_bytes() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    assert upstream_body(raw, parse_fields(raw, "chat"), "m", None) is raw


def test_client_cache_salt_only_narrows_and_alias_rewritten() -> None:
    raw = json.dumps(
        {
            "model": "alias",
            "cache_salt": "someone-else",
            "stream": True,
            "stream_options": {"include_usage": False},
            "messages": [{"role": "user", "content": "x"}],
        }
    ).encode()
    body = json.loads(upstream_body(raw, parse_fields(raw, "chat"), "real", "mine"))
    assert body["model"] == "real"
    assert body["cache_salt"].startswith("mine/") and "someone-else" not in body["cache_salt"]
    assert body["stream_options"] == {"include_usage": True}
    body = json.loads(upstream_body(raw, parse_fields(raw, "chat"), "real", None))
    assert "cache_salt" not in body


def test_usage_event_is_read_and_dropped_unless_asked_for() -> None:
    block = (
        b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}\n\n'
        b"data: [DONE]\n\n"
    )
    usage = Usage()
    out = _take_usage(block, usage, False)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (3, 5, True)
    assert b"prompt_tokens" not in out and out.endswith(b"data: [DONE]\n\n")
    assert out.startswith(b'data: {"choices": [{"delta"')
    assert _take_usage(block, Usage(), True) == block


@pytest.mark.parametrize(
    "kind,body,param",
    [
        ("embedding", {"model": "m"}, "input"),
        ("embedding", {"model": "m", "input": []}, "input"),
        ("responses", {"model": "m"}, "input"),
        ("responses", {"model": "m", "input": [1]}, "input[0]"),
        ("responses", {"model": "m", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"model": "m", "input": "hi", "stream": "yes"}, "stream"),
        ("tokenize", {"prompt": "hi"}, "model"),
        ("score", {"model": "m", "text_1": "q"}, "text_2"),
        ("score", {"model": "m", "text_1": 5, "text_2": "d"}, "text_1"),
        ("score", {"model": "m", "text_1": "q", "text_2": ["d", ""]}, "text_2[1]"),
        ("score", {"model": "m", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("rerank", {"model": "m", "documents": ["d"]}, "query"),
        ("rerank", {"model": "m", "query": "q", "documents": []}, "documents"),
        ("rerank", {"model": "m", "query": "q", "documents": [{"title": "x"}]}, "documents[0]"),
        ("rerank", {"model": "m", "query": "q", "documents": ["d"], "top_n": 2}, "top_n"),
        ("rerank", {"model": "m", "query": "q", "documents": ["d"], "top_n": True}, "top_n"),
    ],
)
def test_new_endpoints_refuse_bad_fields_naming_them(
    kind: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_fields(json.dumps(body).encode(), kind)
    assert info.value.param == param


def test_responses_fields_read_input_items_as_turns_and_the_output_cap() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ],
        "max_output_tokens": 9,
        "stream": True,
    }
    fields = parse_fields(json.dumps(body).encode(), "responses")
    assert (
        fields.max_tokens == 9 and fields.stream and fields.max_tokens_field == "max_output_tokens"
    )
    assert [m["role"] for m in fields.messages or []] == ["system", "user", "assistant", "user"]
    assert fields.messages[1]["content"] == "Hi"  # type: ignore[index]
    embedding = parse_fields(b'{"model": "m", "input": [[1, 2], [3]]}', "embedding")
    assert embedding.max_tokens == 0 and embedding.prompt == [[1, 2], [3]]


def test_score_and_rerank_count_each_pair_and_generate_nothing() -> None:
    score = parse_fields(b'{"model": "m", "text_1": "q", "text_2": ["a", "b"]}', "score")
    assert score.max_tokens == 0 and score.prompt == ["q", "a", "q", "b"]
    pairs = parse_fields(b'{"model": "m", "text_1": ["q", "r"], "text_2": ["a", "b"]}', "score")
    assert pairs.prompt == ["q", "a", "r", "b"]
    body = {"model": "m", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1}
    rerank = parse_fields(json.dumps(body).encode(), "rerank")
    assert rerank.max_tokens == 0 and rerank.prompt == ["q", "a", "q", "b"]


def test_rerank_usage_of_total_tokens_alone_is_read_as_prompt_tokens() -> None:
    usage = Usage()
    usage.take({"total_tokens": 42})
    assert (usage.prompt_tokens, usage.completion_tokens, usage.reported) == (42, 0, True)


@pytest.mark.parametrize(
    ("kind", "body", "param", "message"),
    [
        ("chat", {"model": "m", "messages": "hello"}, "messages",
         "Invalid type for 'messages': expected an array of message objects, got a string."),
        ("chat", {"model": 123, "messages": [{"role": "user", "content": "x"}]}, "model",
         "Invalid type for 'model': expected a string, got a number."),
        ("completion", {"model": "m", "prompt": {}}, "prompt",
         "Invalid type for 'prompt': expected a string, an array of strings or an array of "
         "token ids, got an object."),
        ("embedding", {"model": "m", "input": 5.5}, "input",
         "Invalid type for 'input': expected a string, an array of strings or an array of "
         "token ids, got a number."),
        ("chat", {"model": "m"}, "messages", "Missing required parameter: 'messages'."),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text",
         "text": 5}]}]}, "messages[0].content[0].text",
         "Invalid type for 'messages[0].content[0].text': expected a string, got a number."),
        ("chat", {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content",
         "Missing required parameter: 'messages[0].content'."),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
         "temperature": "hot"}, "temperature",
         "Invalid type for 'temperature': expected a number, got a string."),
        ("completion", {"model": "m", "prompt": ["a", {}]}, "prompt[1]",
         "Invalid type for 'prompt[1]': expected a string, a token id or an array of token ids, "
         "got an object."),
        ("responses", {"model": "m", "input": [{"role": "user", "content": [{"type":
         "input_text", "text": None}]}]}, "input[0].content[0].text",
         "Missing required parameter: 'input[0].content[0].text'."),
    ],
)  # fmt: skip
def test_a_wrong_type_is_named_as_a_wrong_type_not_as_missing(
    kind: str, body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        parse_fields(json.dumps(body).encode(), kind)
    assert (exc.value.param, exc.value.message) == (param, message)


@pytest.mark.parametrize(
    ("edit", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1]}, "stop[0]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_sampling_fields_out_of_range_are_400_naming_them(edit: dict[str, Any], param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **edit}
    with pytest.raises(InvalidRequestError) as exc:
        parse_fields(json.dumps(body).encode(), "chat")
    assert exc.value.param == param
    ok = {"model": "m", "messages": [{"role": "assistant", "tool_calls": []}], "temperature": 0}
    assert parse_fields(json.dumps(ok).encode(), "chat").messages == ok["messages"]
