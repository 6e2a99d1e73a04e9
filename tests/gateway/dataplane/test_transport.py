"""LeanTransport: keep-alive reuse, streamed bodies, and httpx's errors for broken servers.

The servers are real sockets: the fake upstream for well-behaved answers, and tiny asyncio
servers that misbehave on purpose (close mid-body, never answer, speak garbage).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.relay.transport import LeanTransport
from tests.gateway.dataplane.harness import REPO_ROOT, wait_until


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


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)


async def test_server_closing_mid_body_is_a_remote_protocol_error(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with lean_client(await bad_server(handler)) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/x", content=b"{}")


async def test_silent_server_is_a_read_timeout(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(30)

    async with lean_client(await bad_server(handler), read_timeout=0.2) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/x", content=b"{}")


async def test_garbage_answer_is_a_protocol_error(bad_server) -> None:  # type: ignore[no-untyped-def]
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
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
