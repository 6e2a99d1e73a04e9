"""The hot routes' response cycle (gateway/lean_cycle.py) writes what uvicorn's writes, byte for
byte, with the head and the first body in one write; and the gateway's protocol closes an idle
keep-alive connection on time with its one self-arming timer (gateway/http_protocol.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.http_protocol import LimitedHeadersProtocol
from gateway.lean_cycle import LeanCycle


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _cycle(kind: type[RequestResponseCycle], keep_alive: bool = True) -> Any:
    transport = _Transport()
    log = logging.getLogger("test")
    return kind(
        scope={"method": "POST", "path": "/v1/completions", "headers": []},  # type: ignore[arg-type]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=log,
        access_logger=log,
        access_log=False,
        default_headers=[(b"date", b"Mon, 07 Dec 2026 01:00:00 GMT")],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )


HEADS: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"content-type", b"application/json"), (b"content-length", b"5")],
    [(b"Content-Type", b"text/event-stream"), (b"X-Request-Id", b"abc\tdef")],
    [(b"transfer-encoding", b"chunked"), (b"x-a", b"1")],
    [(b"content-length", b"5"), (b"connection", b"keep-alive, Close")],
    [(b"x-ratelimit-limit-requests", b"60"), (b"retry-after", b"1"), (b"x-e", b"")],
]


BODIES = [[(b"hello", False)], [(b"hel", True), (b"lo", False)], [(b"", True), (b"hello", False)]]


@pytest.mark.parametrize("headers", HEADS)
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("bodies", BODIES)
async def test_the_same_bytes_as_uvicorn_with_the_head_and_first_body_in_one_write(
    headers: list[tuple[bytes, bytes]], keep_alive: bool, bodies: list[tuple[bytes, bool]]
) -> None:
    outcomes = []
    for kind in (RequestResponseCycle, LeanCycle):
        cycle = _cycle(kind, keep_alive)
        await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})
        for body, more in bodies:
            await cycle.send({"type": "http.response.body", "body": body, "more_body": more})
        transport = cycle.transport
        state = (cycle.response_complete, cycle.keep_alive, transport.closed)
        outcomes.append((b"".join(transport.writes), state, len(transport.writes)))
    (uvicorn_bytes, uvicorn_state, uvicorn_writes), (lean_bytes, lean_state, lean_writes) = outcomes
    assert lean_bytes == uvicorn_bytes and lean_state == uvicorn_state
    assert lean_writes == uvicorn_writes - 1  # the head left with the first body


@pytest.mark.parametrize(
    "header", [(b"bad name", b"v"), (b"x-a", b"line\r\nbreak"), (b"x-a", b"nul\x00")]
)
async def test_a_bad_header_fails_as_uvicorn_fails(header: tuple[bytes, bytes]) -> None:
    errors = []
    for kind in (RequestResponseCycle, LeanCycle):
        cycle = _cycle(kind)
        with pytest.raises(RuntimeError) as caught:
            await cycle.send({"type": "http.response.start", "status": 200, "headers": [header]})
        errors.append((str(caught.value), cycle.transport.writes))
    assert errors[0] == errors[1]


async def test_a_head_without_a_body_is_written_when_the_app_ends() -> None:
    cycle = _cycle(LeanCycle)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("broke after the head")

    await cycle.run_asgi(app)
    assert cycle.transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert cycle.transport.closed


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_an_idle_keep_alive_connection_closes_on_time() -> None:
    config = uvicorn.Config(
        _answer, port=0, http=LimitedHeadersProtocol, lifespan="off", log_config=None
    )
    config.timeout_keep_alive = 0.4  # type: ignore[assignment]
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):  # until it listens
        if server.started:
            break
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
        for _ in range(3):  # busy, then idle for less than the timeout: kept
            await loop.sock_sendall(sock, request)
            assert (await loop.sock_recv(sock, 4096)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.25)
        began = loop.time()
        assert await loop.sock_recv(sock, 4096) == b""  # closed by the server
        waited = loop.time() - began
        assert 0.05 < waited < 0.5  # 0.4 s after the last response, 0.25 s of it slept
        sock.close()
    finally:
        server.should_exit = True
        await task
