"""The two hot routes served without FastAPI's per-request machinery.

``POST /v1/chat/completions`` and ``POST /v1/completions`` take no declared parameters, so
FastAPI's router, dependency solving, exit stacks and exception middleware add only cost to
them. :class:`HotRoutes` is a pure ASGI middleware placed inside the request-context and
body-size middlewares (so request ids, overhead headers, metrics, in-flight counting and the
413 limit apply unchanged) that answers those two routes itself: it builds a Starlette
``Request``, calls the handler, and turns :class:`~portico.errors.APIError` into the one error
shape exactly as ``install_error_handlers`` does. Every other request (admin, models, health,
other methods on these paths) goes on to the FastAPI app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from portico.errors import APIError

Handler = Callable[[Request, str, str], Awaitable[Response]]

HOT_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class HotRoutes:
    """Answers ``POST`` on :data:`HOT_PATHS` with ``handler(request, kind, path)``."""

    def __init__(self, app: ASGIApp, handler: Handler) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = HOT_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.handler(Request(scope, receive), kind, scope["path"])
        except APIError as exc:
            response = JSONResponse(exc.to_dict(), status_code=exc.status_code,
                                    headers=exc.headers)
        await response(scope, receive, send)
