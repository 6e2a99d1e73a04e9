"""The hot routes served without FastAPI's per-request machinery.

The model-serving routes (``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/score``, the rerank paths, ``/v1/responses``, ``/tokenize``,
``/detokenize``) take no declared
parameters, so FastAPI's middleware stack (server-error, telemetry and body-limit layers),
router, dependency solving, exit stacks and exception middleware add only cost to them.
:class:`GatewayApp` is the FastAPI app with one change: those are dispatched, before FastAPI's
stack, to their own pure-ASGI layer, :class:`HotEdge` — request context (ids, overhead header,
metrics, in-flight count), the body-size limit (413), then the route: a Starlette ``Request``
to the handler, and an error turned into a response with
:func:`portico.http_errors.error_response`, as the FastAPI app's handlers do; an unexpected
exception is a 500 in that shape (then re-raised for the server to log), as FastAPI's
server-error layer would answer. Every other request (admin, models, health, metrics, other
methods on these paths) goes through FastAPI unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.metrics import GatewayMetrics
from gateway.relay.request_context import InFlight, RequestEdge
from portico.errors import APIError
from portico.http_errors import (
    BodyTooLarge,
    declared_too_large,
    error_response,
    limited_receive,
    payload_too_large,
)

log = logging.getLogger("portico.gateway")

Handler = Callable[[Request, str, str], Awaitable[Response]]

HOT_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",  # vLLM's aliases: Jina's path and Cohere's v2
    "/v2/rerank": "rerank",
    "/v1/responses": "responses",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}


class HotEdge(RequestEdge):
    """The hot routes' whole stack in one layer: the request context (its id, the edge's
    headers, the metrics, the in-flight count), the body-size limit (413), then the route:
    ``handler(request, kind, path)``, whose error becomes a response with
    :func:`portico.http_errors.error_response`; an unexpected exception is a 500 in that
    shape when no response started, then re-raised for the server to log.

    One coroutine where there were three (the context, the limit, the routes): every
    suspension and resumption of a request passed through each of them. ``send`` is wrapped
    once (the context's ``edge_send``); ``receive`` is wrapped to count the body only when no
    ``content-length`` declared it (the server reads no more than a declared length)."""

    def __init__(
        self, handler: Handler, max_bytes: int, metrics: GatewayMetrics, in_flight: InFlight
    ) -> None:
        super().__init__(metrics, in_flight)
        self.handler = handler
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = self.enter(scope)
        send = self.edge_send(ctx, send)
        path = scope["path"]
        try:
            too_large = declared_too_large(scope, self.max_bytes)
            if too_large:
                await payload_too_large(self.max_bytes)(scope, receive, send)
                return
            if too_large is None:  # no length declared: count the body as it arrives
                receive = limited_receive(receive, self.max_bytes)
            try:
                response = await self.handler(Request(scope, receive), HOT_PATHS[path], path)
            except APIError as exc:
                response = error_response(exc)
            await response(scope, receive, send)
        except ClientDisconnect:
            return  # the client left before its body arrived: no one to answer, nothing taken
        except BodyTooLarge:
            if not ctx.status:  # else the response is under way: it cannot become a 413
                await payload_too_large(self.max_bytes)(scope, receive, send)
        except Exception as exc:
            if getattr(exc, "status_code", None) != 413 and not ctx.status:
                await error_response(exc)(scope, receive, send)
            raise
        finally:
            self.record(scope, ctx)


def hot_stack(
    handler: Handler, max_bytes: int, metrics: GatewayMetrics, in_flight: InFlight
) -> ASGIApp:
    """The hot routes' pure-ASGI stack: request context, the body-size limit, the routes,
    as one layer (:class:`HotEdge`)."""
    return HotEdge(handler, max_bytes, metrics, in_flight)


class GatewayApp(FastAPI):
    """FastAPI, with ``POST`` on :data:`HOT_PATHS` sent to ``hot_app`` once it is set."""

    hot_app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = self.hot_app
        if (
            hot is not None
            and scope["type"] == "http"
            and scope["path"] in HOT_PATHS
            and scope["method"] == "POST"
        ):
            scope["app"] = self
            await hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
