"""The lean load generator against the real fake upstream: exact request counts, chunked and
sized answers, timeouts and refused connections become failed samples (never exceptions)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from load import gateway_stack as gs
from load.open_loop import Shot, build_request, closed_loop, open_loop, run_async


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    with gs.direct_upstream(tmp_path_factory.mktemp("openloop"), None) as port:
        yield port


def _shot(port: int, stream: bool, **extra: object) -> Shot:
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": stream, **extra}
    return Shot(
        "stream" if stream else "json",
        "t",
        build_request(f"127.0.0.1:{port}", "/v1/completions", body, "sk-test"),
    )


def test_build_request_is_valid_http() -> None:
    raw = build_request("h:1", "/v1/completions", {"a": 1}, "sk-1", {"x-request-id": "r1"})
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1"
    assert "Authorization: Bearer sk-1" in lines and "x-request-id: r1" in lines
    assert f"Content-Length: {len(body)}" in lines and json.loads(body) == {"a": 1}


def test_open_loop_sends_exactly_and_times_streams_to_the_first_chunk(upstream: int) -> None:
    shots = [_shot(upstream, False), _shot(upstream, True, fake_chunk_delay_ms=20)]
    samples = run_async(open_loop("127.0.0.1", upstream, shots, 200.0, 10))
    assert len(samples) == 10 and {s.status for s in samples} == {200}
    streams = [s for s in samples if s.label == "stream"]
    assert len(streams) == 5
    # three chunks 20 ms apart: the first arrives well before the end (ordering, not timing)
    assert all(s.first_s < s.total_s for s in streams)


def test_timeouts_and_refused_connections_are_failed_samples(upstream: int) -> None:
    slow = [_shot(upstream, True, fake_chunk_delay_ms=2000)]
    samples = run_async(open_loop("127.0.0.1", upstream, slow, 100.0, 2, timeout_s=0.2))
    assert [s.status for s in samples] == [0, 0]
    assert all("no full answer" in s.error for s in samples)
    closed = gs.free_port()
    samples, _ = run_async(
        closed_loop("127.0.0.1", closed, [_shot(closed, False)], 2, num_requests=3)
    )
    assert len(samples) == 3 and all(s.status == 0 and s.error for s in samples)


def test_closed_loop_stops_at_its_request_budget(upstream: int) -> None:
    samples, elapsed = run_async(
        closed_loop("127.0.0.1", upstream, [_shot(upstream, False)], 4, num_requests=25)
    )
    assert len(samples) == 25 and elapsed > 0 and {s.status for s in samples} == {200}
    with pytest.raises(ValueError):
        run_async(closed_loop("127.0.0.1", upstream, [], 1, num_requests=1))
    with pytest.raises(ValueError):
        run_async(open_loop("127.0.0.1", upstream, [_shot(upstream, False)], 0, 1))


def test_errors_from_the_upstream_keep_their_status(upstream: int) -> None:
    shots = [_shot(upstream, False, fake_status=503)]
    samples = run_async(open_loop("127.0.0.1", upstream, shots, 100.0, 3))
    assert [s.status for s in samples] == [503] * 3 and all(not s.error for s in samples)
