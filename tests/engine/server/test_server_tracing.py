"""The engine's spans (engine/server/tracing.py), in-process over the tiny random Llama, with
the SDK's in-memory exporter: a request's span continues the caller's ``traceparent`` and has
``queue`` and ``execute`` children with the request's usage; off, nothing is installed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from tiny_engine import make_engine

from engine.async_engine import AsyncLLMEngine
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from engine.server.tracing import EngineTraceMiddleware, EngineTracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def post(app: Any, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            return await client.post(path, json=body, headers=headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_spans_join_the_callers_trace(tiny: Any, stream: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = AsyncLLMEngine(make_engine(tiny))
    app = create_app(engine, ServerSettings(served_model_name="tiny"), EngineTracing(provider))
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": stream,
            "temperature": 0}  # fmt: skip
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "req-7"}
    resp = await post(app, "/v1/completions", body, headers)
    assert resp.status_code == 200, resp.text

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"engine /v1/completions", "queue", "execute"}
    server = spans["engine /v1/completions"]
    assert server.kind == SpanKind.SERVER
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT_ID
    assert dict(server.attributes or {})["portico.request_id"] == "req-7"
    assert dict(server.attributes or {})["http.response.status_code"] == 200
    queue, execute = spans["queue"], spans["execute"]
    for child in (queue, execute):
        assert child.parent is not None and child.parent.span_id == server.context.span_id
    assert queue.start_time <= queue.end_time <= execute.start_time + 1 <= execute.end_time + 1
    assert server.start_time <= queue.start_time and execute.end_time <= server.end_time
    attrs = dict(execute.attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] > 0 and attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.server.time_to_first_token"] > 0
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    # the engine was idle: scheduled in the first step after it came in, its prompt in one
    # step, and no step was in flight when it arrived
    assert attrs["portico.engine.steps_to_first_token"] == 1
    queued = dict(queue.attributes or {})
    assert queued["portico.engine.steps_to_schedule"] == 1
    assert "portico.engine.step_in_flight_s" not in queued


def test_off_installs_nothing(tiny: Any) -> None:
    app = create_app(AsyncLLMEngine(make_engine(tiny)), ServerSettings(served_model_name="tiny"))
    assert not any(m.cls is EngineTraceMiddleware for m in app.user_middleware)
    assert app.state.serving.metrics.on_finished is None
    assert EngineTracing.from_env({}) is None
