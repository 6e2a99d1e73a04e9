"""The edge's helpers: read_body gives what starlette's ``Request.body()`` gives; the cached
labelled children of a metric are the metric's own."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import ClientDisconnect, Request

from gateway.relay.request_context import LabelledChildren, read_body


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


def test_a_cached_child_is_the_metrics_own_child() -> None:
    registry = CollectorRegistry()
    counter = Counter("reqs", "requests", ["tenant", "status"], registry=registry)
    histogram = Histogram("lat", "latency", ["tier"], registry=registry)
    requests, latency = LabelledChildren(counter), LabelledChildren(histogram)
    requests.get("t1", "200").inc()
    requests.get("t1", "200").inc()
    requests.get("t2", "429").inc()
    latency.get("small").observe(0.25)
    assert requests.get("t1", "200") is counter.labels("t1", "200")
    assert registry.get_sample_value("reqs_total", {"tenant": "t1", "status": "200"}) == 2
    assert registry.get_sample_value("reqs_total", {"tenant": "t2", "status": "429"}) == 1
    assert registry.get_sample_value("lat_sum", {"tier": "small"}) == 0.25
