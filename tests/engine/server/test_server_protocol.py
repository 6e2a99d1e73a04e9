"""Request validation and the pure pieces of the server (no engine needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server import sse
from engine.server.metrics import ServerMetrics, token_buckets
from engine.server.protocol import parse_body
from engine.server.protocol_chat import CHAT_UNSUPPORTED, ChatCompletionRequest
from engine.server.protocol_completions import (
    COMPLETION_UNSUPPORTED,
    CompletionRequest,
    EmbeddingRequest,
)
from engine.stats import EngineStats
from portico.errors import InvalidRequestError, ServiceUnavailableError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields: object) -> ChatCompletionRequest:
    return parse_body(
        ChatCompletionRequest, json.dumps(dict(CHAT, **fields)).encode(), CHAT_UNSUPPORTED
    )


def test_explicit_nulls_mean_defaults_as_in_openais_api() -> None:
    req = chat(n=None, logprobs=None, temperature=None, stream=None, max_tokens=None)
    assert req.n == 1 and req.logprobs is False and req.temperature is None
    assert req.requested_max_tokens is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=10, max_completion_tokens=3).requested_max_tokens == 3


def test_harmless_values_of_unsupported_fields_pass() -> None:
    req = chat(
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        store=False,
        parallel_tool_calls=True,
        service_tier="auto",
        modalities=["text"],
    )
    assert req.tools == []


@pytest.mark.parametrize("field", sorted(CHAT_UNSUPPORTED))
def test_every_unsupported_chat_field_is_refused_by_name(field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat(**{field: {"anything": 1}})
    assert info.value.param == field
    assert info.value.code == "unsupported_parameter"


@pytest.mark.parametrize("field", sorted(COMPLETION_UNSUPPORTED))
def test_every_unsupported_completion_field_is_refused_by_name(field: str) -> None:
    body = {"model": "m", "prompt": "x", field: 7}
    with pytest.raises(InvalidRequestError) as info:
        parse_body(CompletionRequest, json.dumps(body).encode(), COMPLETION_UNSUPPORTED)
    assert info.value.param == field


def test_text_content_parts_are_joined_and_developer_is_a_system_role() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert req.messages[1].text() == "ab"


def test_union_type_errors_name_the_parameter_once() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(CompletionRequest, b'{"model": "m", "prompt": 5}')
    assert info.value.param == "prompt"
    assert info.value.message == (
        "Invalid type for 'prompt': expected a string, an array of strings or an array of "
        "token ids, got a number."
    )


def test_huge_invalid_input_gives_a_bounded_message() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(
            CompletionRequest, json.dumps({"model": "m", "prompt": "x", "x" * 10_000: 1}).encode()
        )
    assert len(info.value.to_dict()["error"]["message"]) <= 500


def test_sse_error_event_is_openais_error_then_done() -> None:
    event = sse.error_event(ServiceUnavailableError("gone", code="engine_dead"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "engine_dead"
    internal = json.loads(sse.error_event(RuntimeError("secret path /x"))[6:])
    assert "secret" not in internal["error"]["message"]
    assert sse.DONE == b"data: [DONE]\n\n"


def test_token_buckets_are_1_2_5_up_to_the_limit() -> None:
    assert token_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]


def test_metrics_have_vllm_names_types_and_a_private_registry() -> None:
    stats = EngineStats(
        num_running=2,
        num_waiting=1,
        num_swapped=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_preemptions=3,
    )
    first = ServerMetrics("m", 1024, lambda: stats)
    second = ServerMetrics("m", 1024, lambda: stats)
    first.track(7).finish(1)
    families = {f.name: f for f in text_string_to_metric_families(first.render().decode())}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds["vllm:num_requests_running"] == "gauge"
    assert kinds["vllm:kv_cache_usage_perc"] == "gauge"
    for counter in (
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
    ):
        assert kinds[counter] == "counter", counter
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert kinds[hist] == "histogram", hist

    def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(metrics.render().decode()):
            for s in family.samples:
                if s.name == name and s.labels == dict(labels, model_name="m"):
                    return s.value
        raise KeyError(name)

    assert value(first, "vllm:prompt_tokens_total") == 7
    assert value(second, "vllm:prompt_tokens_total") == 0  # no shared global registry
    assert value(first, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(first, "vllm:num_requests_waiting") == 2  # swapped requests wait too
    assert value(first, "vllm:prefix_cache_hits_total") == 4


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "m", "messages": "hello"}, "messages",
         "Invalid type for 'messages': expected an array of message objects, got a string."),
        ({"model": 123, "messages": [{"role": "user", "content": "x"}]}, "model",
         "Invalid type for 'model': expected a string, got a number."),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text",
         "Invalid type for 'messages[0].content[0].text': expected a string, got a number."),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content",
         "Missing required parameter: 'messages[0].content'."),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
         "temperature", "Invalid type for 'temperature': expected a number, got a string."),
    ],
)  # fmt: skip
def test_the_engine_names_a_wrong_type_as_the_gateway_does(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(ChatCompletionRequest, json.dumps(body).encode())
    assert (info.value.param, info.value.message) == (param, message)


def test_the_engine_names_a_wrong_embedding_input_type() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_body(EmbeddingRequest, b'{"model": "m", "input": 5.5}')
    assert info.value.param == "input"
    assert info.value.message.endswith("got a number.")
