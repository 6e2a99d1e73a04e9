"""Server-sent events exactly as OpenAI frames them: ``data: <json>\\n\\n``, ending ``[DONE]``.

A stream that fails after its first byte cannot change its HTTP status any more, so the error
travels as one ``data: {"error": {...}}`` event (OpenAI's error object) followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from portico.errors import APIError, error_body

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    """The event a stream sends when it fails midway (bounded message, no internals leaked)."""
    if isinstance(exc, APIError):
        return event(exc.to_dict())
    return event(error_body("The engine failed while generating this response.", "internal_error",
                            code="engine_error"))
