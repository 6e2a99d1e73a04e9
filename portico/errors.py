"""One error shape for every Portico endpoint: OpenAI's.

Every error the gateway or the engine answers is
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the status that
ARCHITECTURE.md names. Code raises an :class:`APIError` subclass; :func:`install_error_handlers`
maps it (and FastAPI's own validation and HTTP errors) to a JSON response in one place.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_MESSAGE_CHARS = 500


class APIError(Exception):
    """An error the client caused or must know about, carried to HTTP in OpenAI's shape."""

    status_code = 500
    error_type = "internal_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(APIError):
    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class PayloadTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(APIError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"


class UpstreamError(APIError):
    status_code = 502
    error_type = "upstream_error"
    default_code = "bad_gateway"


# OpenAI's error object as a JSON Schema, for the OpenAPI documents of the gateway and engine.
ERROR_SCHEMA_DOC: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object, with the message bounded so no error echoes a huge input back."""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def status_error_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "internal_error" if status >= 500 else "invalid_request_error")


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one short sentence naming the first bad parameter."""
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
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


def install_error_handlers(app: Any) -> None:
    """Map APIError, FastAPI's validation errors and HTTP errors to OpenAI's shape (never 422)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    async def on_api_error(request: Any, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)

    async def on_validation(request: Any, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    async def on_http(request: Any, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        return JSONResponse(
            error_body(detail, status_error_type(exc.status_code), code=code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)


class BodySizeLimitMiddleware:
    """Answer 413 in OpenAI's shape when a request body exceeds ``max_bytes``.

    Checks Content-Length up front and counts streamed (chunked) bodies as they arrive, so a
    client cannot slip a large body past the limit by omitting the header.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            error_body(
                f"Request body too large: the limit is {self.max_bytes} bytes.",
                "invalid_request_error",
                code="request_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` mid-body. An HTTPException, so that a framework that reads the
    body for a route (FastAPI wraps other errors into a 400 "error parsing the body") re-raises
    it and the handlers answer 413; the middleware answers 413 itself when nothing did."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"Request body too large: the limit is {max_bytes} bytes.")
