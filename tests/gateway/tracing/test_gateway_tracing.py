"""The gateway's OpenTelemetry spans, in-process against a real supervised fake engine and a
real Redis: checked with the SDK's in-memory exporter, and exported over OTLP/HTTP to a real
receiver (a local HTTP server decoding the protobuf export requests). Off by default."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.config import parse_config
from gateway.tracing import GatewayTracing
from portico.tracing import tracing_enabled
from tests.gateway.dataplane.harness import ADMIN_KEY, fake_engine_command
from tests.gateway.tracing.otlp_receiver import OTLPReceiver

A = {"authorization": f"Bearer {ADMIN_KEY}"}
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def gateway_config(tmp_path: Path, redis_url: str) -> Any:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "routing.yaml").write_text("{}\n")
    (policies / "retry.yaml").write_text("base_backoff_s: 0.01\neject_after_failures: 20\n")
    return parse_config(
        {
            "policies_dir": str(policies),
            "runtime_dir": str(tmp_path / "run"),
            "redis": {"url": redis_url, "data_dir": str(tmp_path / "data")},
            "engines": [
                {"name": "fake", "command": fake_engine_command(), "count_tokens_with": "estimate"}
            ],
        }
    )


@contextlib.asynccontextmanager
async def serve(config: Any, env: dict[str, str]) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    app = create_app(config, env=env)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield app, client


async def tenant_key(client: httpx.AsyncClient) -> str:
    body = {"id": "acme", "name": "A", "plan": "standard"}
    resp = await client.post("/admin/v1/tenants", headers=A, json=body)
    assert resp.status_code == 201, resp.text
    resp = await client.post("/admin/v1/tenants/acme/keys", headers=A, json={})
    return str(resp.json()["key"])


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "stream": stream,
        **extra,
    }


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[str]:
    return [s.name for s in spans if s.parent and s.parent.span_id == parent.context.span_id]


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Tracing on, into the SDK's in-memory exporter (the gateway asks ``from_env`` for its
    tracing; here that answers with an in-memory provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(GatewayTracing, "from_env", classmethod(lambda cls, env: cls(provider)))
    return exporter


async def test_request_spans_and_genai_attributes(
    tmp_path: Path, redis_url: str, memory: InMemorySpanExporter
) -> None:
    env = {"PORTICO_ADMIN_KEY": ADMIN_KEY}
    async with serve(gateway_config(tmp_path, redis_url), env) as (_, client):
        key = {"authorization": f"Bearer {await tenant_key(client)}"}
        memory.clear()

        resp = await client.post("/v1/chat/completions", headers=key, json=chat())
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        spans = list(memory.get_finished_spans())
        (root,) = [s for s in spans if s.parent is None]
        assert root.name == "chat fake" and root.kind == SpanKind.SERVER
        assert children(spans, root) == ["authenticate", "route", "admit", "upstream attempt"]
        attrs = dict(root.attributes or {})
        assert attrs["gen_ai.operation.name"] == "chat"
        assert attrs["gen_ai.request.model"] == "fake" and attrs["gen_ai.response.model"] == "fake"
        assert attrs["gen_ai.request.max_tokens"] == 5
        assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert attrs["portico.tenant"] == "acme" and attrs["http.response.status_code"] == 200
        assert attrs["portico.request_id"] == resp.headers["x-request-id"]
        (attempt,) = by_name(spans, "upstream attempt")
        assert attempt.kind == SpanKind.CLIENT
        assert dict(attempt.attributes or {})["portico.replica"] == "fake-0"
        assert "gen_ai.server.time_to_first_token" not in attrs  # not a stream

        # A stream: the relay is its own span, and the time to the first event is recorded.
        memory.clear()
        headers = {**key, "traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"}
        resp = await client.post("/v1/chat/completions", headers=headers, json=chat(stream=True))
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        spans = list(memory.get_finished_spans())
        (root,) = by_name(spans, "chat fake")
        assert f"{root.context.trace_id:032x}" == TRACE_ID  # continues the caller's trace
        assert root.parent is not None and f"{root.parent.span_id:016x}" == "b7ad6b7169203331"
        assert children(spans, root) == [
            "authenticate", "route", "admit", "upstream attempt", "stream"
        ]  # fmt: skip
        attrs = dict(root.attributes or {})
        assert attrs["gen_ai.server.time_to_first_token"] > 0
        assert attrs["gen_ai.request.stream"] is True
        assert attrs["gen_ai.usage.output_tokens"] == 5

        # Refused at authentication: the span says 401 and nothing was forwarded.
        memory.clear()
        bad = {"authorization": "Bearer sk-" + "x" * 43}
        resp = await client.post("/v1/chat/completions", headers=bad, json=chat())
        assert resp.status_code == 401
        spans = list(memory.get_finished_spans())
        (root,) = [s for s in spans if s.parent is None]
        assert dict(root.attributes or {})["http.response.status_code"] == 401
        assert children(spans, root) == ["authenticate"]

        # An engine answering 503: one span per attempt (the policy's 3), each saying so.
        memory.clear()
        resp = await client.post("/v1/chat/completions", headers=key, json=chat(fake_status=503))
        assert resp.status_code == 503
        spans = list(memory.get_finished_spans())
        attempts = by_name(spans, "upstream attempt")
        assert len(attempts) == 3
        assert {dict(a.attributes or {})["http.response.status_code"] for a in attempts} == {503}


async def test_each_attempt_carries_its_traceparent(memory: InMemorySpanExporter) -> None:
    from gateway.fleet.pool import Replica

    tracing = GatewayTracing.from_env({})
    assert tracing is not None
    seen: list[dict[str, str]] = []

    async def send(replica: Any, url: Any, payload: bytes, headers: dict[str, str], fields: Any):
        seen.append(headers)
        from gateway.relay.proxy import Exchange

        return Exchange(200, "application/json", body=b"{}")

    replica = Replica("r-0", httpx.AsyncClient())
    original = {"x-request-id": "abc"}
    url = httpx.URL("http://engine/v1/completions")
    await tracing.attempt(send, replica, url, b"{}", original, None)
    await replica.client.aclose()
    (attempt,) = memory.get_finished_spans()
    assert original == {"x-request-id": "abc"}  # the shared headers are not changed
    version, trace_id, span_id, flags = seen[0]["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert trace_id == f"{attempt.context.trace_id:032x}"
    assert span_id == f"{attempt.context.span_id:016x}"  # the engine's parent is the attempt


def test_tracing_is_off_unless_otel_env_asks() -> None:
    assert not tracing_enabled({})
    assert not tracing_enabled({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing_enabled({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert not tracing_enabled(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}
    )
    assert not tracing_enabled({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    assert GatewayTracing.from_env({}) is None


async def test_off_by_default_no_tracer_anywhere(tmp_path: Path, redis_url: str) -> None:
    env = {"PORTICO_ADMIN_KEY": ADMIN_KEY}
    async with serve(gateway_config(tmp_path, redis_url), env) as (app, client):
        gateway = app.state.gateway
        assert gateway.tracing is None
        assert all(u.tracer is None for u in gateway.upstreams.values())
        key = {"authorization": f"Bearer {await tenant_key(client)}"}
        resp = await client.post("/v1/chat/completions", headers=key, json=chat())
        assert resp.status_code == 200


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    r.start()
    yield r
    r.stop()


async def test_spans_reach_a_real_otlp_receiver(
    tmp_path: Path, redis_url: str, receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the standard variables: the SDK's exporter reads them from the environment.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gw-under-test")
    env = {**os.environ, "PORTICO_ADMIN_KEY": ADMIN_KEY}
    async with serve(gateway_config(tmp_path, redis_url), env) as (app, client):
        assert app.state.gateway.tracing is not None
        key = {"authorization": f"Bearer {await tenant_key(client)}"}
        resp = await client.post("/v1/chat/completions", headers=key, json=chat())
        assert resp.status_code == 200
    # Leaving the lifespan shut the provider down, which flushed the batch.
    spans = receiver.spans()
    assert spans, "no export request arrived"
    assert {service for service, _ in spans} == {"gw-under-test"}
    names = {span.name for _, span in spans}
    assert {"chat fake", "authenticate", "route", "admit", "upstream attempt"} <= names
    (root,) = [span for _, span in spans if span.name == "chat fake"]
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.model"].string_value == "fake"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 5
    attempt = next(span for _, span in spans if span.name == "upstream attempt")
    assert attempt.parent_span_id == root.span_id and attempt.trace_id == root.trace_id
