"""A stream cut by the tenant's token budget ends with an error event naming the quota."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from gateway.relay.budget_stop import watch_budget
from gateway.relay.proxy import Exchange

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


def _finish(reason: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"%s"}]}\n\n' % reason.encode()


async def _blocks(*blocks: bytes) -> AsyncIterator[bytes]:
    for block in blocks:
        yield block


def _relay(first: bytes, *rest: bytes) -> bytes:
    exchange = Exchange(200, "text/event-stream", first=first, rest=_blocks(*rest))
    watch_budget(exchange, "monthly_token_budget of tenant 'acme'", 7)

    async def read() -> bytes:
        assert exchange.rest is not None
        return (exchange.first or b"") + b"".join([b async for b in exchange.rest])

    return asyncio.run(read())


def _errors(stream: bytes) -> list[dict[str, object]]:
    events = [json.loads(e[6:]) for e in stream.split(b"\n\n") if e.startswith(b"data: {")]
    return [e["error"] for e in events if "error" in e]


def test_a_cut_stream_ends_with_the_quota_before_done() -> None:
    out = _relay(CHUNK, CHUNK, _finish("length"), DONE)
    assert out.endswith(DONE)
    (error,) = _errors(out)
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
    assert "monthly_token_budget of tenant 'acme'" in str(error["message"])
    assert "7 tokens" in str(error["message"])


def test_a_stream_in_one_block_gets_it_too() -> None:
    out = _relay(CHUNK + _finish("length") + DONE)
    assert len(_errors(out)) == 1 and out.endswith(DONE)


def test_a_stream_that_stopped_by_itself_gets_no_notice() -> None:
    out = _relay(CHUNK, _finish("stop"), DONE)
    assert _errors(out) == [] and out == CHUNK + _finish("stop") + DONE
