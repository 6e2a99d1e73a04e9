"""A stream's per-chunk path (gateway/relay/stream_relay.py) and the proxy's relay of it: SSE
events cut whole as they arrive, the answer's end known from the read that brings it, and a
stream whose whole answer came with its first block sent in one piece, with the same bytes as
one that arrives in pieces.

The engines are real sockets: tiny asyncio servers that write a chunked SSE answer at once or
in pieces, reached through the lean transport the gateway uses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.body.fields import parse_fields
from gateway.fleet.pool import Pool, Replica
from gateway.metrics import GatewayMetrics
from gateway.relay.proxy import LocalUpstream, RelayResponse
from gateway.relay.retry import RetryPolicy
from gateway.relay.stream_relay import SseEvents, StreamRest
from gateway.relay.transport import LeanTransport, request_head, request_start
from tests.gateway.dataplane.harness import read_request

TIMEOUTS: dict[str, float | None] = {"connect": 5.0, "read": 5.0}


def _event(text: str, completion: int, final: bool = False) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}
    choices = [] if final else [{"index": 0, "text": text, "finish_reason": None}]
    body = {"id": "c", "object": "text_completion", "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


EVENTS = [_event("", 0), _event(" a", 1), _event(" b", 2), _event("", 2, final=True)]
STREAM = b"".join(EVENTS) + b"data: [DONE]\n\n"


def _chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]


Writes = list[list[bytes]]  # what the engine writes: groups, with a pause between groups


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Callable[[Writes], Awaitable[str]]]:
    """An engine on a Unix socket that answers every request with ``writes``."""
    servers: list[asyncio.AbstractServer] = []

    async def start(writes: Writes) -> str:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for group in writes:
                    writer.write(b"".join(group))
                    await writer.drain()
                    await asyncio.sleep(0.05)

        path = str(tmp_path / f"engine{len(servers)}.sock")
        servers.append(await asyncio.start_unix_server(handler, path))
        return path

    yield start
    for server in servers:
        server.close()


async def _answer(transport: LeanTransport) -> Any:
    head = request_head(request_start("POST", httpx.URL("http://engine/v1/x")), {}, 2)
    return await transport.request(head, b"{}", TIMEOUTS)


async def test_the_read_that_ends_the_body_says_so(engine) -> None:  # type: ignore[no-untyped-def]
    transport = LeanTransport(uds=await engine([[*_chunked(STREAM), b"0\r\n\r\n"]]))
    answer = await _answer(transport)
    assert await answer.receive() == STREAM and answer.finished
    await answer.aclose()
    assert len(transport._idle) == 1  # read to its end without another call: reused
    await transport.aclose()


async def test_whole_events_are_cut_from_pieces_and_a_tail_ends_the_stream(engine) -> None:  # type: ignore[no-untyped-def]
    first, second = STREAM[:30], STREAM[30:]
    writes = [_chunked(first), [*_chunked(second, b"data: tail"), b"0\r\n\r\n"]]
    transport = LeanTransport(uds=await engine(writes))
    events = SseEvents(await _answer(transport))
    blocks = []
    while (block := await events.next_block()) is not None:
        blocks.append(block)
        assert block.endswith(b"\n\n") and not block.startswith(b"\n")
    assert blocks == [STREAM, b"data: tail\n\n"]  # nothing whole in the first 30 bytes
    assert events.finished
    await events.answer.aclose()
    await transport.aclose()


async def test_an_answer_cut_inside_an_event_is_not_finished_until_its_end(engine) -> None:  # type: ignore[no-untyped-def]
    writes = [_chunked(EVENTS[0] + EVENTS[1][:10]), [*_chunked(EVENTS[1][10:]), b"0\r\n\r\n"]]
    transport = LeanTransport(uds=await engine(writes))
    events = SseEvents(await _answer(transport))
    assert await events.next_block() == EVENTS[0] and not events.finished
    assert await events.next_block() == EVENTS[1] and events.finished
    assert await events.next_block() is None
    await events.answer.aclose()
    await transport.aclose()


async def _relayed(uds: str) -> tuple[Any, list[dict[str, Any]], list[str]]:
    """One streamed completion through LocalUpstream to the engine at ``uds``, relayed to a
    recording client: the exchange, the messages the client got, what ran at the end."""
    transport = LeanTransport(uds=uds)
    client = httpx.AsyncClient(transport=transport, base_url="http://engine")
    replica = Replica("r0", client, transport=transport, timeouts=TIMEOUTS, up=True)
    upstream = LocalUpstream(Pool("m", [replica]), RetryPolicy(max_attempts=1), GatewayMetrics())
    raw = b'{"model":"m","prompt":"x","stream":true}'
    fields = parse_fields(raw, "completion")
    payload = upstream.payload(raw, fields, "m", None, None)
    exchange = await upstream.exchange("/v1/completions", payload, fields, "rid", None)
    sent: list[dict[str, Any]] = []
    ended: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def on_close() -> None:
        ended.append(f"settled {exchange.usage.completion_tokens} tokens")

    await RelayResponse(exchange, [], on_close)({"type": "http"}, receive, send)
    ended.append(f"replica outstanding {replica.outstanding}")
    ended.append(f"connections idle {len(transport._idle)}")
    await client.aclose()
    return exchange, sent, ended


def _client_bytes(sent: list[dict[str, Any]]) -> bytes:
    assert sent[0]["type"] == "http.response.start"
    assert [m["more_body"] for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
    return b"".join(m["body"] for m in sent[1:])


async def test_a_stream_whole_in_its_first_block_is_sent_in_one_piece(engine) -> None:  # type: ignore[no-untyped-def]
    exchange, sent, ended = await _relayed(await engine([[*_chunked(*EVENTS), b"0\r\n\r\n"]]))
    assert exchange.rest is None  # nothing left to wait for
    assert len(sent) == 2 and sent[1]["more_body"] is False  # the body and its end at once
    assert ended == ["settled 2 tokens", "replica outstanding 0", "connections idle 1"]
    whole = _client_bytes(sent)
    # the same answer in pieces: a relayed rest, the same bytes, the same accounting
    pieces = [[*_chunked(EVENTS[0])], [*_chunked(*EVENTS[1:3])], [*_chunked(EVENTS[3])]]
    exchange, sent, ended = await _relayed(await engine([*pieces, [b"0\r\n\r\n"]]))
    assert isinstance(exchange.rest, StreamRest) and len(sent) > 2
    assert ended == ["settled 2 tokens", "replica outstanding 0", "connections idle 1"]
    assert _client_bytes(sent) == whole
    # usage hidden as the client asked none: null on each chunk, no usage-only event
    assert whole == b"".join(_without_usage(e) for e in EVENTS[:3])


def _without_usage(event: bytes) -> bytes:
    return event[: event.index(b',"usage":{')] + b',"usage":null}\n\n'
