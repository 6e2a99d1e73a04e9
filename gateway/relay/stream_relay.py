"""A stream's per-chunk path, from the upstream's bytes to the blocks the client gets.

:class:`SseEvents` cuts an upstream answer's body into whole SSE events as it arrives;
:class:`StreamRest` relays the blocks after a stream's first (usage read, and hidden as the
client asked, by ``gateway/relay/usage_relay.py``). Both are plain classes whose methods the
relay calls directly, not async generators: a chunk resumes no generator layers, and no
generator is registered with the event loop per stream. :attr:`SseEvents.finished` tells the
proxy (``gateway/relay/proxy.py``) when the whole answer came with its first block, so the
stream is sent in one piece with nothing left to wait for.
"""

from __future__ import annotations

import logging

import httpx

from gateway.fleet.pool import Pool, Replica
from gateway.fleet.replica_load import Lease
from gateway.relay.transport import UpstreamAnswer
from gateway.relay.usage_relay import Usage, UsageView, _take_usage, error_event

log = logging.getLogger("portico.gateway.proxy")  # the proxy's channel, as before the split


class SseEvents:
    """An upstream's SSE body as whole events, as they arrive (:meth:`next_block`: one or
    more whole events a call). A class over the answer's ``receive``, not an async generator:
    the relay calls it directly (no generator layers to resume per chunk, none registered
    with the event loop per stream). ``finished``: the answer has ended and every event of
    it was given out, so the caller can know, without another call, that none will follow.
    """

    __slots__ = ("answer", "_buffer")

    def __init__(self, answer: UpstreamAnswer) -> None:
        self.answer = answer
        self._buffer = b""

    @property
    def finished(self) -> bool:
        return self.answer.finished and not self._buffer.strip()

    async def next_block(self) -> bytes | None:
        """The next whole events, waiting for them; an unterminated tail at the end of the
        body is given as an event of its own; None once nothing is left."""
        receive = self.answer.receive
        while (data := await receive()) is not None:
            buffer = self._buffer + data if self._buffer else data
            cut = buffer.rfind(b"\n\n") + 2
            if cut == 1:  # no whole event yet
                self._buffer = buffer
                continue
            self._buffer = buffer[cut:]
            return buffer if cut == len(buffer) else buffer[:cut]
        tail, self._buffer = self._buffer, b""
        return tail + b"\n\n" if tail.strip() else None


class StreamRest:
    """The blocks of a stream after its first, as the client gets them (usage read, and
    hidden as ``view`` says), ended by an error event if the upstream breaks the stream.

    An async iterator written as a class, not an async generator: a block is one call into
    :meth:`SseEvents.next_block`, with no generator layers to resume per chunk and none
    registered with the event loop per stream.
    """

    __slots__ = ("events", "usage", "view", "seen", "lease", "pool", "replica", "ended")

    def __init__(
        self,
        events: SseEvents,
        usage: Usage,
        view: UsageView,
        seen: list[bytes] | None,
        lease: Lease | None,
        pool: Pool,
        replica: Replica,
    ) -> None:
        self.events = events
        self.usage = usage
        self.view = view
        self.seen = seen
        self.lease = lease  # until the event after the role chunk: the first token is out
        self.pool = pool
        self.replica = replica
        self.ended = False

    def __aiter__(self) -> StreamRest:
        return self

    async def __anext__(self) -> bytes:
        usage = self.usage
        while not self.ended:
            try:
                block = await self.events.next_block()
            except httpx.HTTPError as exc:
                self.ended = True
                log.warning("stream from replica %s broke: %s", self.replica.name, exc)
                self.pool.record_failure(self.replica)
                return error_event(f"The upstream stream broke: {type(exc).__name__}.")
            if block is None:
                self.ended = True
                break
            if self.lease is not None:
                self.lease.first_token()
                self.lease = None
            if self.seen is not None and not usage.reported:
                self.seen.append(block)
            out = _take_usage(block, usage, self.view)
            if out:
                return out
        raise StopAsyncIteration
