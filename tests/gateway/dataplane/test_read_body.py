"""read_body: the body a hot route reads, the same as starlette's ``Request.body()`` gives."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import ClientDisconnect, Request

from gateway.relay.request_context import read_body


def request_of(messages: list[dict[str, Any]]) -> Request:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.parametrize(
    "messages",
    [
        [{"type": "http.request", "body": b'{"a":1}'}],
        [{"type": "http.request"}],
        [
            {"type": "http.request", "body": b'{"a"', "more_body": True},
            {"type": "http.request", "body": b"", "more_body": True},
            {"type": "http.request", "body": b":1}", "more_body": False},
        ],
    ],
)
async def test_the_body_is_starlettes_and_stays_on_the_request(
    messages: list[dict[str, Any]],
) -> None:
    expected = await request_of(messages).body()
    request = request_of(messages)
    assert await read_body(request) == expected
    assert await request.body() == expected  # kept: receive is not called again
    assert await read_body(request) == expected


async def test_a_client_gone_before_its_body_is_a_client_disconnect() -> None:
    request = request_of(
        [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    )
    with pytest.raises(ClientDisconnect):
        await read_body(request)
    assert request._is_disconnected
