"""The hot routes served without FastAPI's per-request machinery.

The model-serving routes (``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/score``, the rerank paths, ``/v1/responses``, ``/tokenize``,
``/detokenize``) take no declared
parameters, so FastAPI's middleware stack (server-error, telemetry and body-limit layers),
router, dependency solving, exit stacks and exception middleware add only cost to them.
:class:`GatewayApp` is the FastAPI app with one change: those are dispatched, before FastAPI's
stack, to their own short pure-ASGI stack — request context (ids, overhead header, metrics,
in-flight count), the body-size limit (413), then :class:`HotRoutes`, which builds a Starlette
``Request``, calls the handler and turns an error into a response with
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
from gateway.relay.request_context import InFlight, RequestContextMiddleware, response_started
from portico.errors import APIError
from portico.http_errors import BodySizeLimitMiddleware, error_response

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


class HotRoutes:
    """The innermost hot-path app: answers with ``handler(request, kind, path)``. It runs
    inside :class:`~gateway.relay.request_context.RequestContextMiddleware`, whose context
    says whether a response started (no layer here wraps ``send``: each would be one more
    coroutine on every send of every response)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        try:
            try:
                response = await self.handler(Request(scope, receive), HOT_PATHS[path], path)
            except APIError as exc:
                response = error_response(exc)
            await response(scope, receive, send)
        except ClientDisconnect:
            return  # the client left before its body arrived: no one to answer, nothing taken
        except Exception as exc:
            if getattr(exc, "status_code", None) == 413:  # the body limit's signal: its answer
                raise
            if not response_started(scope):
                await error_response(exc)(scope, receive, send)
            raise


def hot_stack(
    handler: Handler, max_bytes: int, metrics: GatewayMetrics, in_flight: InFlight
) -> ASGIApp:
    """The hot routes' pure-ASGI stack: request context, the body-size limit, the routes. The
    context knows when a response starts, so neither layer inside it wraps ``send``."""
    limited = BodySizeLimitMiddleware(
        HotRoutes(handler), max_bytes=max_bytes, started=response_started
    )
    return RequestContextMiddleware(limited, metrics=metrics, in_flight=in_flight)


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
