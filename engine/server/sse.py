"""Server-sent events exactly as OpenAI frames them: ``data: <json>\\n\\n``, ending ``[DONE]``.

A stream that fails after its first byte cannot change its HTTP status any more, so the error
travels as one ``data: {"error": {...}}`` event (OpenAI's error object) followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from portico.errors import APIError, error_body

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk_writer(
    request_id: str,
    object_name: str,
    created: int,
    model: str,
    include_usage: bool,
    usage_so_far: Callable[[], dict[str, Any]] | None = None,
) -> Callable[..., bytes]:
    """``chunk(choices, **extra) -> bytes``: one streamed chunk event of a response.

    Every chunk carries the response's id, object, created and model; with ``include_usage``
    it also carries ``"usage": null`` until the final usage chunk sets it, as OpenAI's do.
    With ``usage_so_far`` (vLLM's ``continuous_usage_stats``) every chunk carries the usage
    counted up to it instead of null.
    """

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": request_id,
            "object": object_name,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage_so_far() if usage_so_far is not None else None
        body.update(extra)
        return event(body)

    return chunk


def error_event(exc: BaseException) -> bytes:
    """The event a stream sends when it fails midway (bounded message, no internals leaked)."""
    if isinstance(exc, APIError):
        return event(exc.to_dict())
    return event(
        error_body(
            "The engine failed while generating this response.",
            "internal_error",
            code="engine_error",
        )
    )
