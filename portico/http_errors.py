"""Errors on the wire: the one function that turns an error into an HTTP response.

:func:`error_response` is the only place an exception becomes OpenAI's error shape with its
status. Every way a request can fail in the gateway or the engine reaches it: FastAPI's
exception handlers (:func:`install_error_handlers`), the gateway's hot routes that skip FastAPI,
the body-size limit (:class:`BodySizeLimitMiddleware`) and the admin client-certificate guard.
The error types themselves live in :mod:`portico.errors`, which knows nothing of HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portico.errors import (
    APIError,
    PayloadTooLargeError,
    error_body,
    param_path,
    status_error_type,
)

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."
# FastAPI's first element of an error's location: where the parameter was read from. The
# parameter is named without it (``format``, not ``query.format``), as the OpenAI SDK does.
_LOCATIONS = ("body", "query", "path", "header", "cookie")


def error_response(exc: BaseException) -> JSONResponse:
    """The response for ``exc``: an :class:`APIError` with its own status, code and headers;
    a request-validation error as 400 (never FastAPI's 422); a framework HTTP error with its
    status; anything else as a 500 that reveals nothing about the failure."""
    if isinstance(exc, APIError):
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)
    if isinstance(exc, RequestValidationError):
        message, param = _validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)
    if isinstance(exc, StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        return JSONResponse(
            error_body(detail, status_error_type(exc.status_code), code=code),
            status_code=exc.status_code,
            headers=exc.headers,
        )
    return JSONResponse(
        error_body(INTERNAL_ERROR_MESSAGE, "internal_error", code="internal_error"),
        status_code=500,
    )


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one short sentence naming the first bad parameter."""
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc and loc[0] in _LOCATIONS:  # where FastAPI found it: not part of the name
        loc = loc[1:]
    param = param_path(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    msg = str(first.get("msg", "invalid value"))
    text = f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."
    if len(errors) > 1:
        text += f" ({len(errors) - 1} more error(s))"
    return text, param


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Answer APIError, FastAPI's validation errors and HTTP errors through
    :func:`error_response`. Unexpected exceptions are left to the app (the engine logs them)."""
    for kind in (APIError, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(kind, _on_error)


class BodySizeLimitMiddleware:
    """Answer 413 in OpenAI's shape when a request body exceeds ``max_bytes``.

    Checks Content-Length up front and counts streamed (chunked) bodies as they arrive, so a
    client cannot slip a large body past the limit by omitting the header.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        path_limits: Mapping[str, int] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # exact paths with their own limit (the gateway's file uploads: batches.max_file_bytes)
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope["path"], self.max_bytes)
        if declared_too_large(scope, max_bytes):
            await self._reject(scope, receive, send, max_bytes)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive(receive, max_bytes), tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(scope, receive, send, max_bytes)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        await payload_too_large(max_bytes)(scope, receive, send)


def declared_too_large(scope: Scope, max_bytes: int) -> bool | None:
    """Whether a ``content-length`` of the request is over ``max_bytes``: True for the first
    that is, False when every one (at least one) is a number within it, None when none is
    (absent or not a number: only counting the body as it arrives can tell)."""
    declared = None
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                if int(value) > max_bytes:
                    return True
            except ValueError:
                continue
            declared = False
    return declared


def limited_receive(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` counting the body's bytes: :class:`BodyTooLarge` past ``max_bytes``."""
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise BodyTooLarge(max_bytes)
        return message

    return limited


def payload_too_large(max_bytes: int) -> JSONResponse:
    """The 413 in OpenAI's shape for a body over ``max_bytes``."""
    return error_response(
        PayloadTooLargeError(f"Request body too large: the limit is {max_bytes} bytes.")
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` mid-body. An HTTPException, so that a framework that reads the
    body for a route (FastAPI wraps other errors into a 400 "error parsing the body") re-raises
    it and the handlers answer 413; the middleware answers 413 itself when nothing did."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"Request body too large: the limit is {max_bytes} bytes.")
