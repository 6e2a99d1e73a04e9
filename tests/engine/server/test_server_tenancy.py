"""The gateway's engine-hop tenant headers against a real engine process: mapped to the
request's tenant (seen in the per-tenant metrics), and a bad value refused with a 400 in
OpenAI's shape that names the header, before anything is queued."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from engine_server_process import MODEL_NAME, EngineProcess, metric

from portico.contract import (
    KV_SHARE_HEADER,
    MAX_RUNNING_HEADER,
    PRIORITY_CLASS_HEADER,
    TENANT_HEADER,
    WEIGHT_HEADER,
)

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 4}
ENDPOINTS = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", COMPLETION),
    ("/v1/responses", {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4}),
    ("/v1/embeddings", {"model": MODEL_NAME, "input": "hi"}),
]


@pytest.fixture(scope="module")
def http(engine_server: EngineProcess) -> httpx.Client:
    return engine_server.client()


def tenant_headers(name: str, **overrides: str) -> dict[str, str]:
    headers = {
        TENANT_HEADER: name,
        WEIGHT_HEADER: "2",
        PRIORITY_CLASS_HEADER: "batch",
        KV_SHARE_HEADER: "0.5",
    }
    headers.update(overrides)
    return headers


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
@pytest.mark.parametrize(
    ("header", "value"),
    [
        (WEIGHT_HEADER, "0"),
        (PRIORITY_CLASS_HEADER, "urgent"),
        (KV_SHARE_HEADER, "2"),
        (MAX_RUNNING_HEADER, "-1"),
    ],
)
def test_a_bad_tenant_header_is_a_400_naming_it(
    http: httpx.Client,
    engine_server: EngineProcess,
    path: str,
    body: dict[str, Any],
    header: str,
    value: str,
) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"
    resp = http.post(path, json=body, headers=tenant_headers(name, **{header: value}))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == header
    assert header in error["message"]
    samples = engine_server.metrics()  # refused before queueing: the tenant was never seen
    assert not [key for key in samples if ("tenant", name) in key[1]]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS[:2])
def test_headers_name_the_tenant_its_tokens_are_counted_for(
    http: httpx.Client, engine_server: EngineProcess, path: str, body: dict[str, Any]
) -> None:
    name = f"acme-{uuid.uuid4().hex[:8]}"
    resp = http.post(path, json=dict(body, ignore_eos=True), headers=tenant_headers(name))
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    samples = engine_server.metrics()
    tokens = "portico_engine_tenant_tokens_total"
    # Tokens as scheduled: the prompt (less any prefix-cache hit) and 3 decodes after the
    # first token, which comes with the prefill.
    prompt = metric(samples, tokens, tenant=name, kind="prompt")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert prompt == usage["prompt_tokens"] - cached
    assert metric(samples, tokens, tenant=name, kind="generation") == 3
    for gauge in ("requests_running", "requests_waiting", "kv_blocks"):
        assert metric(samples, f"portico_engine_tenant_{gauge}", tenant=name) == 0
    # vLLM's totals keep their names beside the per-tenant series.
    assert ("vllm:num_requests_running", (("model_name", MODEL_NAME),)) in samples


def test_without_headers_the_request_is_the_default_tenants(
    http: httpx.Client, engine_server: EngineProcess
) -> None:
    tokens = "portico_engine_tenant_tokens_total"
    before = metric(engine_server.metrics(), tokens, tenant="default", kind="generation")
    resp = http.post("/v1/completions", json=dict(COMPLETION, ignore_eos=True))
    assert resp.status_code == 200, resp.text
    after = metric(engine_server.metrics(), tokens, tenant="default", kind="generation")
    assert after - before == 3
