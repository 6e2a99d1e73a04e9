"""One error shape for every Portico endpoint: OpenAI's.

Every error the gateway or the engine answers is
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`` with the status that
ARCHITECTURE.md names. Code raises an :class:`APIError` subclass; :mod:`portico.http_errors`
turns it (and the web framework's own validation and HTTP errors) into a response in one place.
This module is only the error types and the body, so code that knows no HTTP can raise them.
"""

from __future__ import annotations

from typing import Any

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


class ParameterError(ValueError):
    """Bad user input, naming the parameter (``param``) so the server can report it (a 400).

    Raised by code that knows no HTTP (the engine core, the engine-hop contract); the servers
    map it to :class:`InvalidRequestError`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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


# ---------------------------------------------------------------- bad-input wording
# One wording for a wrong type and one spelling of a nested parameter, shared by the gateway
# (which checks the fields it reads) and the engine (pydantic), so a client reads the same
# sentence whichever answered: ``Invalid type for 'messages': expected an array of message
# objects, got a string.`` with ``param`` in the OpenAI SDK's style, ``messages[0].content``.

# What a parameter holds, where its type alone would say too little.
EXPECTED_TYPES: dict[str, str] = {
    "model": "a string",
    "messages": "an array of message objects",
    "prompt": "a string, an array of strings or an array of token ids",
    "input": "a string, an array of strings or an array of token ids",
}


def json_type_name(value: Any) -> str:
    """The JSON type of a decoded value, with its article: ``a string``, ``an object``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def param_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A parameter's location as the OpenAI SDK writes it: ``messages[0].content[1].text``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def type_error(param: str, value: Any, expected: str | None = None) -> InvalidRequestError:
    """A 400 for a parameter that is present with the wrong type (never "missing")."""
    what = expected or EXPECTED_TYPES.get(param, "another type")
    return InvalidRequestError(
        f"Invalid type for '{param}': expected {what}, got {json_type_name(value)}.", param=param
    )
