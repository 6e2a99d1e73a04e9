"""vLLM's request fields against a real engine process: served with vLLM's meaning, or refused
with a message that says "not supported" (never "unrecognized").

Benchmarks written for vLLM (guidellm sends ``stream_options.continuous_usage_stats`` on every
streaming request) must run against Portico unchanged; a client that sends a vLLM field this
engine cannot honour must learn that it is not supported, by name.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

from engine.server.protocol_chat import VLLM_CHAT_UNSUPPORTED
from engine.server.protocol_completions import VLLM_COMPLETION_UNSUPPORTED

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
# values that ask for something: none of them is vLLM's default
ASKING = {
    "use_beam_search": True,
    "length_penalty": 2.0,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 2,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "prompt_logprobs": 1,
    "logits_processors": ["x"],
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "request_id": "mine",
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "best_of": 2,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": "sometimes",
    "documents": [{"text": "d"}],
    "chat_template": "{{ x }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "mm_processor_kwargs": {"a": 1},
    "include_reasoning": "yes",
    "prompt_embeds": "AAAA",
}


@pytest.fixture(scope="module")
def http(engine_server: EngineProcess) -> httpx.Client:
    return engine_server.client()


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    return events


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    resp = http.post(path, json=dict(body, stream=True, stream_options=options, ignore_eos=True))
    assert resp.status_code == 200, resp.text
    events = sse_events(resp)
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages), usages
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion)  # never goes back
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert events[-1]["choices"] == [] and completion[-1] == 4  # the final chunk: all of it


def test_continuous_usage_stats_without_include_usage_adds_no_usage(http: httpx.Client) -> None:
    options = {"continuous_usage_stats": True}
    resp = http.post("/v1/chat/completions", json=dict(CHAT, stream=True, stream_options=options))
    assert resp.status_code == 200, resp.text
    assert all("usage" not in e for e in sse_events(resp))


@pytest.mark.parametrize(
    "path,body,field",
    [("/v1/chat/completions", CHAT, f) for f in sorted(VLLM_CHAT_UNSUPPORTED)]
    + [("/v1/completions", COMPLETION, f) for f in sorted(VLLM_COMPLETION_UNSUPPORTED)],
)
def test_a_vllm_field_this_engine_cannot_honour_is_refused_as_not_supported(
    http: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    resp = http.post(path, json=dict(body, **{field: ASKING[field]}))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field
    assert "not supported" in error["message"] and "nrecognized" not in error["message"]


def test_vllm_fields_at_their_default_values_are_served(http: httpx.Client) -> None:
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "spaces_between_special_tokens": True,
        "return_tokens_as_token_ids": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "echo": False,
        "chat_template_kwargs": {},
        "best_of": 1,
    }
    resp = http.post("/v1/chat/completions", json=dict(CHAT, **defaults))
    assert resp.status_code == 200, resp.text
    resp = http.post(
        "/v1/completions", json=dict(COMPLETION, add_special_tokens=True, use_beam_search=False)
    )
    assert resp.status_code == 200, resp.text
