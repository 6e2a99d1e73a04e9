"""LeanTransport: keep-alive reuse, streamed bodies, and httpx's errors for broken servers.

The servers are real sockets: the fake upstream for well-behaved answers, and tiny asyncio
servers that misbehave on purpose (close mid-body, never answer, speak garbage).
"""

from __future__ import annotations

import asyncio
import gzip
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.relay.transport import LeanTransport, request_head, request_start
from tests.gateway.dataplane.harness import REPO_ROOT, read_request, wait_until


@pytest.fixture(scope="module")
def fake_uds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("lean") / "fake.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "load.fake_upstream", "--uds", str(path)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_until(path.exists, timeout=30)
    yield str(path)
    proc.terminate()
    proc.wait(10)


def lean_client(uds: str, read_timeout: float = 30.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=LeanTransport(uds=uds),
        base_url="http://engine",
        timeout=httpx.Timeout(read_timeout, connect=5.0),
    )


async def test_keep_alive_reuses_one_connection(fake_uds: str) -> None:
    async with lean_client(fake_uds) as client:
        transport: LeanTransport = client._transport  # type: ignore[assignment]
        made = 0
        original = transport._connection

        async def counting(timeout: float | None):  # type: ignore[no-untyped-def]
            nonlocal made
            made += not transport._idle
            return await original(timeout)

        transport._connection = counting  # type: ignore[method-assign]
        for i in range(5):
            r = await client.post(
                "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": i + 1}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == i + 1
        assert made == 1


async def test_chunked_stream_arrives_in_pieces(fake_uds: str) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True, "fake_chunk_delay_ms": 20}
    async with (
        lean_client(fake_uds) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        pieces = [p async for p in resp.aiter_raw()]
    assert len(pieces) >= 5
    assert b"".join(pieces).endswith(b"data: [DONE]\n\n")


@pytest.fixture
async def bad_server(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    servers: list[asyncio.AbstractServer] = []

    async def start(
        handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    ) -> str:
        path = str(tmp_path / f"bad{len(servers)}.sock")
        servers.append(await asyncio.start_unix_server(handler, path))
        return path

    yield start
    for server in servers:
        server.close()


async def test_server_closing_mid_body_is_a_remote_protocol_error(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with lean_client(await bad_server(handler)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/x", content=b"{}")


async def test_silent_server_is_a_read_timeout(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with lean_client(await bad_server(handler), read_timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/x", content=b"{}")


async def test_garbage_answer_is_a_protocol_error(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async with lean_client(await bad_server(handler)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/x", content=b"{}")


async def test_nothing_listening_is_a_connect_error(tmp_path: Path) -> None:
    async with lean_client(str(tmp_path / "nobody.sock")) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get("/health")


async def test_an_idle_connection_past_its_expiry_is_closed_not_reused(fake_uds: str) -> None:
    transport = LeanTransport(uds=fake_uds, idle_timeout_s=0.05)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        body = {"model": "m", "prompt": "x", "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        first = transport._idle[-1]
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert transport._idle[-1] is first  # reused while fresh
        await asyncio.sleep(0.1)
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert transport._idle[-1] is not first and first.closed


# -- the proxy's door: LeanTransport.request with a head written as bytes, no httpx models

TIMEOUTS = {"connect": 5.0, "read": 5.0}


def engine_head(path: str, headers: dict[str, str], body: bytes) -> bytes:
    start = request_start("POST", httpx.URL("http://engine" + path))
    return request_head(start, headers, len(body))


def test_request_head_matches_what_the_engine_hop_sends() -> None:
    head = engine_head(
        "/v1/chat/completions",
        {"content-type": "application/json", "x-portico-tenant": "t1", "content-length": "9"},
        b"{}",
    )
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine\r\n"
        b"content-type: application/json\r\nx-portico-tenant: t1\r\n"
        b"content-length: 2\r\n\r\n"
    )
    azure = httpx.URL("https://x.example:8443/openai/deployments/d/chat/completions?api-version=1")
    assert request_start("POST", azure) == (
        "POST /openai/deployments/d/chat/completions?api-version=1 HTTP/1.1\r\n"
        "host: x.example:8443\r\n"
    )


async def test_the_server_reads_the_head_and_body_as_written(bad_server) -> None:  # type: ignore[no-untyped-def]
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head + await reader.readexactly(7))
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Type: text/x\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    transport = LeanTransport(uds=await bad_server(handler))
    body = b'{"a":1}'
    answer = await transport.request(engine_head("/v1/x", {"x-request-id": "r1"}, body), body, {})
    assert answer.status_code == 201 and answer.header(b"content-type") == b"text/x"
    assert await answer.read() == b"ok"
    await answer.aclose()
    assert seen == [engine_head("/v1/x", {"x-request-id": "r1"}, body) + body]
    await transport.aclose()


async def test_request_keeps_one_connection_alive_across_requests(fake_uds: str) -> None:
    transport = LeanTransport(uds=fake_uds)
    conns = set()
    for i in range(4):
        body = b'{"model":"m","prompt":"x","max_tokens":%d}' % (i + 1)
        answer = await transport.request(engine_head("/v1/completions", {}, body), body, TIMEOUTS)
        assert answer.status_code == 200
        assert b'"completion_tokens":%d' % (i + 1) in (await answer.read()).replace(b" ", b"")
        await answer.aclose()
        await answer.aclose()  # a second close gives nothing back twice
        conns.add(transport._idle[-1])
        assert len(transport._idle) == 1 and not transport._busy
    assert len(conns) == 1
    await transport.aclose()


async def test_a_stream_arrives_in_pieces_and_a_half_read_one_is_not_reused(fake_uds: str) -> None:
    transport = LeanTransport(uds=fake_uds)
    body = b'{"model":"m","prompt":"x","max_tokens":5,"stream":true,"fake_chunk_delay_ms":20}'
    answer = await transport.request(engine_head("/v1/completions", {}, body), body, TIMEOUTS)
    pieces = [p async for p in answer.aiter_raw()]
    await answer.aclose()
    assert len(pieces) >= 5 and b"".join(pieces).endswith(b"data: [DONE]\n\n")
    assert len(transport._idle) == 1  # read to its end: reused
    answer = await transport.request(engine_head("/v1/completions", {}, body), body, TIMEOUTS)
    conn = answer._conn
    await anext(answer.aiter_raw())
    await answer.aclose()  # the client left midway: the engine must see the connection close
    assert conn.closed and not transport._idle and not transport._busy
    await transport.aclose()


async def test_engine_closing_mid_stream_raises_after_the_chunks_it_sent(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    transport = LeanTransport(uds=await bad_server(handler))
    answer = await transport.request(engine_head("/x", {}, b"{}"), b"{}", TIMEOUTS)
    got = []
    with pytest.raises(httpx.RemoteProtocolError):
        async for piece in answer.aiter_raw():
            got.append(piece)
    assert got == [b"data: 1\n\n"]
    await answer.aclose()
    assert not transport._idle and not transport._busy
    await transport.aclose()


async def test_bad_status_line_is_a_protocol_error_and_frees_the_connection(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 2x0 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    transport = LeanTransport(uds=await bad_server(handler))
    with pytest.raises(httpx.RemoteProtocolError):
        await transport.request(engine_head("/x", {}, b"{}"), b"{}", TIMEOUTS)
    assert not transport._idle and not transport._busy
    await transport.aclose()


async def test_silence_before_the_head_or_inside_the_body_is_a_read_timeout(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(30)

    timeouts = {"connect": 5.0, "read": 0.2}
    transport = LeanTransport(uds=await bad_server(silent))
    with pytest.raises(httpx.ReadTimeout):
        await transport.request(engine_head("/x", {}, b"{}"), b"{}", timeouts)
    assert not transport._busy
    await transport.aclose()
    transport = LeanTransport(uds=await bad_server(stalls))
    answer = await transport.request(engine_head("/x", {}, b"{}"), b"{}", timeouts)
    with pytest.raises(httpx.ReadTimeout):
        await answer.read()
    await answer.aclose()
    assert not transport._idle and not transport._busy
    await transport.aclose()


async def test_a_cancelled_request_closes_its_connection(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    transport = LeanTransport(uds=await bad_server(silent))
    task = asyncio.create_task(transport.request(engine_head("/x", {}, b"{}"), b"{}", TIMEOUTS))
    await asyncio.sleep(0.1)
    (conn,) = transport._busy
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert conn.closed and not transport._busy and not transport._idle
    await transport.aclose()


async def test_nothing_listening_is_a_connect_error_on_the_lean_door(tmp_path: Path) -> None:
    transport = LeanTransport(uds=str(tmp_path / "nobody.sock"))
    with pytest.raises(httpx.ConnectError):
        await transport.request(engine_head("/x", {}, b""), b"", TIMEOUTS)
    await transport.aclose()


async def test_read_decodes_a_gzip_body_and_aiter_raw_does_not(bad_server) -> None:  # type: ignore[no-untyped-def]
    packed = gzip.compress(b'{"ok":true}')

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n"
                % len(packed)
                + packed
            )
            await writer.drain()

    transport = LeanTransport(uds=await bad_server(handler))
    answer = await transport.request(engine_head("/x", {}, b"{}"), b"{}", TIMEOUTS)
    assert await answer.read() == b'{"ok":true}'
    await answer.aclose()
    answer = await transport.request(engine_head("/x", {}, b"{}"), b"{}", TIMEOUTS)
    assert b"".join([p async for p in answer.aiter_raw()]) == packed
    await answer.aclose()
    await transport.aclose()
