"""Per-request bookkeeping at the outermost edge of the gateway (a pure ASGI middleware).

It stamps the arrival time, takes or creates ``x-request-id``, counts requests in flight, and
on the way out adds ``x-request-id`` and ``x-portico-overhead-ms`` to every response and
records the request metrics. Overhead is the time from arrival to the response start minus the
time spent waiting on upstreams (``ctx.upstream_s``, set by the handler): for a stream, the
response starts when the first chunk is ready, so it is the gateway's share of the first byte.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics

CTX_KEY = "portico.ctx"
MAX_REQUEST_ID_CHARS = 128
_getrandbits = random.getrandbits


@dataclass(slots=True)
class RequestContext:
    """What the edge knows about one request; the handler fills in labels as it learns them."""

    arrival: float
    request_id: str
    tenant: str = ""
    model: str = ""
    tier: str = ""
    upstream_s: float = 0.0
    # the response's status once it has started (0: not yet); the layers inside read it
    # here rather than each wrapping ``send`` to see the start go by
    status: int = 0


class InFlight:
    """Requests being handled now; ``wait_idle`` returns when none is left (for the drain)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


# The caller's id is kept only when it is safe everywhere it travels (logs, response headers,
# the engine request's headers): the same rule as nginx/portico.conf's map. Anything else
# (spaces, non-ASCII bytes, over 128 characters) is replaced by a minted id, as nginx does.
_CALLER_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % MAX_REQUEST_ID_CHARS)


def request_id(scope: Scope) -> str:
    """The request's id: the caller's ``x-request-id`` when it is safe (above), else a new
    one: 128 random bits as 32 hex digits, drawn from ``random`` (seeded from the OS once per
    process, and again in a forked child) rather than ``os.urandom``, whose ``getrandom``
    system call was paid on every request. The id must be unique, not secret: it names the
    request in logs, traces and headers, and grants nothing."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if _CALLER_REQUEST_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return f"{_getrandbits(128):032x}"


async def read_body(request: Request) -> bytes:
    """The whole body of ``request``, as ``await request.body()`` gives it (and kept on the
    request, so a later ``request.body()`` returns it too), read with a plain loop over
    ``receive``: starlette's wraps the same loop in two async generators, and the event loop
    registers every async generator in a weak set (``Request.body`` was about 3% of the gateway's
    event loop, a quarter of it that registration).
    Raises :class:`ClientDisconnect` when the client leaves before its body arrived."""
    if hasattr(request, "_body"):
        return request._body
    receive = request.receive
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            request._is_disconnected = True
            raise ClientDisconnect()
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body
    return body


class LabelledChildren:
    """The labelled children of one Prometheus metric, each looked up once: ``labels()``
    validates, converts and takes a lock on every call (about 2% of the gateway's event loop
    for the three calls of each request). The gateway never removes a child, so the one a
    label set got first stays that metric's; the cache holds what the metric holds."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.children: dict[tuple[str, ...], Any] = {}

    def get(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = self.metric.labels(*values)
        return child


class RequestEdge:
    """The edge's part of every request, for the layers that wrap one: its context (id,
    arrival; ``scope[CTX_KEY]``, whose ``status`` says whether the response has started), the
    ``send`` that adds the edge's headers, the in-flight count and the request metrics."""

    def __init__(self, metrics: GatewayMetrics, in_flight: InFlight) -> None:
        self.metrics = metrics
        self.in_flight = in_flight
        self.ttfb = LabelledChildren(metrics.ttfb)
        self.latency = LabelledChildren(metrics.latency)
        self.requests = LabelledChildren(metrics.requests)

    def enter(self, scope: Scope) -> RequestContext:
        """The request's context, put in its scope and counted in flight (until
        :meth:`record`)."""
        ctx = RequestContext(time.perf_counter(), request_id(scope))
        scope[CTX_KEY] = ctx
        self.in_flight.enter()
        self.metrics.in_flight.inc()
        return ctx

    def edge_send(self, ctx: RequestContext, send: Send) -> Send:
        """``send`` with the edge's part: the response's status on ``ctx``, the
        ``x-request-id`` and ``x-portico-overhead-ms`` headers, the first byte's time."""
        metrics = self.metrics
        first_byte = False

        async def edge_send(message: Message) -> None:
            nonlocal first_byte
            if message["type"] == "http.response.start":
                ctx.status = message["status"]
                overhead = max(0.0, time.perf_counter() - ctx.arrival - ctx.upstream_s)
                metrics.overhead.observe(overhead)
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", ctx.request_id.encode("latin-1")))
                headers.append((b"x-portico-overhead-ms", b"%.3f" % (overhead * 1000)))
                message = {**message, "headers": headers}
            elif not first_byte and message.get("body"):
                first_byte = True
                self.ttfb.get(ctx.tier).observe(time.perf_counter() - ctx.arrival)
            await send(message)

        return edge_send

    def record(self, scope: Scope, ctx: RequestContext) -> None:
        """The request entered with :meth:`enter` has ended: leave the in-flight count and
        record the request metrics of a ``/v1/`` path."""
        self.in_flight.leave()
        self.metrics.in_flight.dec()
        if scope["path"].startswith("/v1/"):
            status = str(ctx.status or 500)  # none started: the server answers 500
            self.requests.get(ctx.tenant, ctx.model, ctx.tier, status).inc()
            self.latency.get(ctx.tier).observe(time.perf_counter() - ctx.arrival)


class RequestContextMiddleware(RequestEdge):
    """Wraps the app: request id, overhead header, in-flight count, request metrics
    (:class:`RequestEdge`)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, in_flight: InFlight) -> None:
        super().__init__(metrics, in_flight)
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = self.enter(scope)
        try:
            await self.app(scope, receive, self.edge_send(ctx, send))
        finally:
            self.record(scope, ctx)
