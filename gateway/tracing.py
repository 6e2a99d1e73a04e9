"""The gateway's OpenTelemetry spans: one per completion request, with its steps as children.

A traced request has a SERVER span (``chat <model>`` / ``text_completion <model>``, continuing
the client's ``traceparent`` if it sent one) and, under it, ``authenticate``, ``route``
(parsing, routing, prompt counting), ``admit``, one CLIENT span per ``upstream attempt``
(whose context travels to the engine as ``traceparent``, so the engine's spans join the trace)
and ``stream`` (first event relayed to the end of a streamed answer). Attributes follow the
GenAI semantic conventions:
``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.request.max_tokens``, ``gen_ai.usage.input_tokens``/``output_tokens``, and
``gen_ai.server.time_to_first_token`` (seconds to the first streamed event) — plus
``portico.tenant``, ``portico.route.tier``, ``portico.request_id`` and the HTTP status.

Off (the default), the gateway holds no :class:`GatewayTracing` and the request path uses
:data:`NO_TRACE`, whose methods do nothing and create nothing: no span object, no context.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.requests import Request

from portico.tracing import provider_from_env

if TYPE_CHECKING:
    import httpx

    from gateway.body.fields import RequestFields
    from gateway.fleet.pool import Replica
    from gateway.identity.principal import Principal
    from gateway.relay.proxy import Exchange
    from gateway.relay.routing import RouteDecision

OPERATIONS = {"chat": "chat", "completion": "text_completion"}
SERVICE_NAME = "portico-gateway"


class _Nothing:
    """A context manager that does nothing (one shared instance: nothing is allocated)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


class NoTrace:
    """The request path's trace when tracing is off: every method is a no-op."""

    __slots__ = ()

    def phase(self, name: str) -> _Nothing:
        return _NOTHING

    def current(self) -> _Nothing:
        return _NOTHING

    def mark(self) -> int:
        return 0

    def routed(
        self, began: int, decision: RouteDecision, fields: RequestFields, principal: Principal
    ) -> None:
        pass

    def answered(self, exchange: Exchange) -> None:
        pass

    def end(self, exchange: Exchange) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass


NO_TRACE = NoTrace()


class RequestTrace(NoTrace):
    """The spans of one traced request; :meth:`end` or :meth:`fail` closes them."""

    __slots__ = ("context", "operation", "span", "started", "stream_span", "tracer")

    def __init__(self, tracer: trace_api.Tracer, span: trace_api.Span, operation: str) -> None:
        self.tracer = tracer
        self.span = span
        self.operation = operation
        self.context = trace_api.set_span_in_context(span)
        self.started = time.perf_counter()
        self.stream_span: trace_api.Span | None = None

    def phase(self, name: str) -> Any:  # type: ignore[override]
        """A child span around one step (ended on exit, exceptions recorded)."""
        return trace_api.use_span(self.tracer.start_span(name, self.context), end_on_exit=True)

    def current(self) -> Any:  # type: ignore[override]
        """Make the request span current, so upstream attempts find their parent."""
        return trace_api.use_span(self.span, end_on_exit=False)

    def mark(self) -> int:
        """Now, for a step recorded once it is over (:meth:`routed`)."""
        return time.time_ns()

    def routed(
        self, began: int, decision: RouteDecision, fields: RequestFields, principal: Principal
    ) -> None:
        """Routing is done: its span (from ``began``), and the request's model attributes.
        A request refused while routing (unknown model, not allowed) has no ``route`` span;
        the request's span carries the refusal."""
        self.tracer.start_span("route", self.context, start_time=began).end()
        span = self.span
        span.update_name(f"{self.operation} {decision.model}")
        span.set_attributes(
            {
                "gen_ai.request.model": fields.model,
                "gen_ai.response.model": decision.model,
                "portico.route.tier": decision.tier,
                "portico.tenant": principal.tenant_id,
                "gen_ai.request.stream": fields.stream,
            }
        )
        if fields.max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", fields.max_tokens)

    def answered(self, exchange: Exchange) -> None:
        """The upstream's first byte is ready: a streamed answer's relay starts now."""
        self.span.set_attribute("http.response.status_code", exchange.status)
        if exchange.body is None:
            ttft = time.perf_counter() - self.started
            self.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
            self.stream_span = self.tracer.start_span("stream", self.context)

    def end(self, exchange: Exchange) -> None:
        span = self.span
        usage = exchange.usage
        if usage.reported:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        span.set_attribute("portico.upstream.attempts", exchange.attempts)
        if exchange.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        if self.stream_span is not None:
            self.stream_span.end()
        span.end()

    def fail(self, exc: BaseException) -> None:
        span = self.span
        status = getattr(exc, "status_code", 500)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", getattr(exc, "code", None) or type(exc).__name__)
        if status >= 500 or not isinstance(status, int):
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.end()


class GatewayTracing:
    """The gateway's tracer over one ``TracerProvider`` (see the module docstring)."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer: trace_api.Tracer = provider.get_tracer("portico.gateway")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GatewayTracing | None:
        provider = provider_from_env(env, SERVICE_NAME)
        return None if provider is None else cls(provider)

    def start(self, request: Request, kind: str, path: str, request_id: str) -> RequestTrace:
        """The SERVER span of one completion request (a child of the caller's traceparent)."""
        parent = self.propagator.extract(request.headers)
        operation = OPERATIONS.get(kind, kind)
        span = self.tracer.start_span(
            operation,
            parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "portico",
                "http.request.method": "POST",
                "url.path": path,
                "portico.request_id": request_id,
            },
        )
        return RequestTrace(self.tracer, span, operation)

    async def attempt(
        self,
        send: Callable[
            [Replica, httpx.URL, bytes, dict[str, str], RequestFields], Awaitable[Exchange]
        ],
        replica: Replica,
        url: httpx.URL,
        payload: bytes,
        headers: dict[str, str],
        fields: RequestFields,
    ) -> Exchange:
        """One upstream attempt as a CLIENT span; its context goes to the engine as
        ``traceparent`` (the hook :class:`~gateway.relay.proxy.LocalUpstream` calls)."""
        with self.tracer.start_as_current_span(
            "upstream attempt",
            kind=SpanKind.CLIENT,
            attributes={"portico.replica": replica.name, "url.path": url.path},
        ) as span:
            carried = dict(headers)
            self.propagator.inject(carried)
            exchange = await send(replica, url, payload, carried, fields)
            span.set_attribute("http.response.status_code", exchange.status)
            if exchange.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            return exchange

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking; call from a thread)."""
        self.provider.shutdown()
