"""The hot routes' stack (gateway/relay/hot_routes.py ``hot_stack``): the request context, the
body-size limit and the routes, with ``send`` wrapped by the context alone. The layers inside
learn from the context whether a response started: an error before it is answered in OpenAI's
shape, one after it is never a second start, and a body over the limit is a 413.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.metrics import GatewayMetrics
from gateway.relay.hot_routes import hot_stack
from gateway.relay.request_context import CTX_KEY, InFlight, read_body

MAX_BYTES = 64


def _scope(headers: list[tuple[bytes, bytes]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"x-request-id", b"req-1"), *headers],
    }


async def _call(
    handler: Any,
    body_parts: list[bytes],
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    sent: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One request through a fresh stack; the messages the server got (also appended to
    ``sent`` as they come, for a call that raises) and the scope."""
    app = hot_stack(handler, MAX_BYTES, GatewayMetrics(), InFlight())
    scope = _scope(headers)
    parts = [
        {"type": "http.request", "body": p, "more_body": i < len(body_parts) - 1}
        for i, p in enumerate(body_parts)
    ]
    sent = [] if sent is None else sent

    async def receive() -> dict[str, Any]:
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent, scope


def _error(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    return sent[0]["status"], json.loads(sent[1]["body"]), dict(sent[0]["headers"])


async def test_a_response_passes_with_the_edge_headers_and_its_status_on_the_context() -> None:
    async def handler(request: Request, kind: str, path: str) -> Response:
        body = await read_body(request)
        return JSONResponse({"kind": kind, "path": path, "got": len(body)})

    sent, scope = await _call(handler, [b"{}", b"{}"])
    status, body, headers = _error(sent)
    assert (status, body) == (200, {"kind": "completion", "path": "/v1/completions", "got": 4})
    assert headers[b"x-request-id"] == b"req-1" and b"x-portico-overhead-ms" in headers
    assert scope[CTX_KEY].status == 200


async def test_an_error_before_the_response_is_a_500_in_openais_shape_then_raised() -> None:
    async def handler(request: Request, kind: str, path: str) -> Response:
        raise RuntimeError("a bug")

    sent: list[dict[str, Any]] = []
    with pytest.raises(RuntimeError, match="a bug"):  # answered, then raised for the log
        await _call(handler, [b"{}"], sent=sent)
    status, body, headers = _error(sent)
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert headers[b"x-request-id"] == b"req-1"


async def test_an_error_after_the_response_started_is_not_a_second_start() -> None:
    class Breaks(Response):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise RuntimeError("mid-body")

    async def handler(request: Request, kind: str, path: str) -> Response:
        return Breaks()

    sent: list[dict[str, Any]] = []
    with pytest.raises(RuntimeError, match="mid-body"):
        await _call(handler, [b"{}"], sent=sent)
    assert [m["type"] for m in sent] == ["http.response.start"]


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_is_a_413(declared: bool) -> None:
    async def handler(request: Request, kind: str, path: str) -> Response:
        await read_body(request)
        return JSONResponse({})

    parts = [b"x" * 40, b"x" * 40]  # 80 bytes, over 64, in a chunked body or declared
    headers = [(b"content-length", b"80")] if declared else []
    sent, scope = await _call(handler, parts, headers)
    status, body, headers_out = _error(sent)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert headers_out[b"x-request-id"] == b"req-1" and scope[CTX_KEY].status == 413


async def test_a_body_over_the_limit_after_the_response_started_is_not_a_second_start() -> None:
    class ReadsLate(Response):
        def __init__(self, request: Request) -> None:
            self.request = request

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await read_body(self.request)  # over the limit: the limit's signal is raised

    async def handler(request: Request, kind: str, path: str) -> Response:
        return ReadsLate(request)

    sent, scope = await _call(handler, [b"x" * 40, b"x" * 40])
    assert [m["type"] for m in sent] == ["http.response.start"] and scope[CTX_KEY].status == 200
