"""The engine's OpenTelemetry spans: one per generation request, joined to the gateway's trace.

A ``POST /v1/...`` request gets a SERVER span (``engine <path>``) whose parent is the caller's
``traceparent`` header, so the gateway's ``upstream attempt`` span is its parent. When the
engine request finishes, two children are recorded from its own timestamps: ``queue`` (arrival
to first scheduled: waiting for a batch slot and KV blocks) and ``execute`` (first scheduled to
finished: prefill and decode), with the GenAI usage attributes, the prefix-cache hit and the
time to first token; ``queue`` counts the engine steps until the request was first scheduled
(``portico.engine.steps_to_schedule``, 1: the first step planned after it came in) and
``execute`` the steps from then to its first token (``portico.engine.steps_to_first_token``,
1: its whole prompt in one step); ``queue`` also has the step that was running when the
request arrived: its length and what was left of it (``portico.engine.step_in_flight_s``,
``portico.engine.step_in_flight_left_s``).

Off by default (``portico/tracing.py`` reads ``OTEL_*``); off, ``create_app`` installs nothing
and the request path is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.outputs import RequestOutput
from portico.tracing import provider_from_env

SERVICE_NAME = "portico-engine"


def _wall_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


class EngineTracing:
    """The engine's tracer over one ``TracerProvider``."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer: trace_api.Tracer = provider.get_tracer("portico.engine")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EngineTracing | None:
        provider = provider_from_env(env, SERVICE_NAME)
        return None if provider is None else cls(provider)

    def record_timing(self, output: RequestOutput) -> None:
        """``queue`` and ``execute`` spans of a finished request, children of the current
        (HTTP) span; times come from the request's own monotonic timestamps."""
        m = output.metrics
        offset = time.time_ns() - time.monotonic_ns()
        arrival = _wall_ns(m.arrival_time, offset)
        scheduled = _wall_ns(m.first_scheduled_time or m.arrival_time, offset)
        finished = _wall_ns(m.finished_time or m.last_token_time or time.monotonic(), offset)
        queue = self.tracer.start_span("queue", start_time=arrival)
        queue.set_attribute("portico.engine.request_id", output.request_id)
        if m.added_step is not None and m.first_scheduled_step is not None:
            # 1: it ran in the first step planned after it entered the engine
            queue.set_attribute(
                "portico.engine.steps_to_schedule", m.first_scheduled_step - m.added_step
            )
        if m.inflight_step_start is not None and m.inflight_step_end is not None:
            queue.set_attributes(
                {
                    "portico.engine.step_in_flight_s": m.inflight_step_end - m.inflight_step_start,
                    "portico.engine.step_in_flight_left_s": m.inflight_step_end - m.arrival_time,
                }
            )
        queue.end(end_time=scheduled)
        execute = self.tracer.start_span("execute", start_time=scheduled)
        execute.set_attributes(
            {
                "portico.engine.request_id": output.request_id,
                "gen_ai.usage.input_tokens": len(output.prompt_token_ids),
                "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in output.outputs),
                "portico.engine.cached_tokens": output.num_cached_tokens,
                "portico.engine.preemptions": m.num_preemptions,
            }
        )
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            execute.set_attribute("gen_ai.server.time_to_first_token", ttft)
            if m.first_token_step is not None and m.first_scheduled_step is not None:
                steps = m.first_token_step - m.first_scheduled_step + 1
                execute.set_attribute("portico.engine.steps_to_first_token", steps)
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        if reasons:
            execute.set_attribute("gen_ai.response.finish_reasons", reasons)
        execute.end(end_time=finished)

    def shutdown(self) -> None:
        self.provider.shutdown()


class EngineTraceMiddleware:
    """A SERVER span around each ``POST /v1/...`` request, continuing its ``traceparent``."""

    def __init__(self, app: ASGIApp, tracing: EngineTracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith("/v1/")
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self.tracing.propagator.extract(headers)
        span = self.tracing.tracer.start_span(
            f"engine {scope['path']}",
            parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": scope["path"],
                "portico.request_id": headers.get("x-request-id", ""),
            },
        )

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        with trace_api.use_span(span, end_on_exit=True):
            await self.app(scope, receive, traced_send)
