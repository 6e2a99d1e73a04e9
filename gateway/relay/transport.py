"""A lean HTTP/1.1 transport for httpx: the gateway's engines (Unix socket or TCP) and its
OpenAI-compatible remote upstreams (TCP, optionally TLS).

The gateway keeps one ``httpx.AsyncClient`` per engine replica or remote endpoint (one HTTP
client pool); this is the transport underneath it. httpcore, httpx's default, spends about a
millisecond of CPU per request in its connection state machine and anyio layers, which is the
whole overhead budget of the gateway; this transport parses responses with ``httptools`` (the
parser uvicorn uses) on a plain asyncio protocol and costs a small fraction of that.

Scope, on purpose: HTTP/1.1, one request per connection at a time, idle connections reused
last-in first-out (and closed once idle longer than ``idle_timeout_s``, so a server's own
keep-alive timeout does not race a reuse), bodies given as bytes. TLS is asyncio's
(``ssl.SSLContext``: certificate verification, a private CA, a client certificate). HTTP/2 is
not spoken here: an upstream configured for it gets httpx's own transport (httpcore + h2).
Response bodies stream as they arrive (chunked or sized); the socket is paused while more than
``HIGH_WATER`` bytes wait for the reader. Errors map to httpx's: ``ConnectError`` /
``ConnectTimeout`` before the request is written (a failed TLS handshake or certificate check
included), ``RemoteProtocolError`` when the server closes early, ``ReadTimeout`` when it goes
silent for longer than the request's read timeout.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator

import httptools
import httpx

HIGH_WATER = 1 << 20
MAX_IDLE = 256
WATCHDOG_INTERVAL_S = 0.5  # read timeouts are enforced to within this


class _Connection(asyncio.Protocol):
    """One socket and the response being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: Exception | None = None
        self.deadline: float | None = None
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"invalid HTTP response: {exc}")
            self._abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = httpx.RemoteProtocolError("the server closed the connection")
        self._wake()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self._wake()

    # -- reading
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def wait(self, timeout: float | None) -> None:
        """Until the server sends something; the transport's watchdog enforces ``timeout``."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.deadline = loop.time() + timeout if timeout is not None else None
        try:
            await self.waiter
        finally:
            self.waiter = None
            self.deadline = None

    def expire(self, now: float) -> None:
        """Called by the watchdog: give up on a server silent past the read deadline."""
        if self.waiter is not None and self.deadline is not None and now > self.deadline:
            self.error = httpx.ReadTimeout("the server did not answer in time")
            self._abort()
            self._wake()

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


class _Body(httpx.AsyncByteStream):
    def __init__(self, conn: _Connection, pool: LeanTransport, timeout: float | None) -> None:
        self.conn = conn
        self.pool = pool
        self.timeout = timeout
        self.done = False
        self.released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                break
            if conn.error is not None:
                raise conn.error
            await conn.wait(self.timeout)
        if conn.error is not None and not conn.complete:
            raise conn.error
        self.done = True

    async def aclose(self) -> None:
        if not self.released:  # a connection goes back to the pool once, never twice
            self.released = True
            self.pool.release(self.conn, self.done and self.conn.keep_alive)


async def read_body(response: httpx.Response) -> bytes:
    """The whole body of ``response``: straight from this transport's stream when the body is
    not content-encoded (httpx's decoder layers cost more than the read), else ``aread``."""
    stream = response.stream
    if isinstance(stream, _Body) and "content-encoding" not in response.headers:
        return b"".join([chunk async for chunk in stream])
    return await response.aread()


class LeanTransport(httpx.AsyncBaseTransport):
    """httpx transport: HTTP/1.1 keep-alive to one server on ``uds`` or ``host:port``.

    ``ssl_context``: speak TLS with this context (``server_hostname`` defaults to ``host``).
    ``idle_timeout_s``: an idle connection older than this is closed rather than reused.
    """

    def __init__(
        self,
        uds: str | None = None,
        host: str = "127.0.0.1",
        port: int = 80,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.uds = uds
        self.host = host
        self.port = port
        self.ssl = ssl_context
        self.server_hostname = server_hostname or (host if ssl_context is not None else None)
        self.idle_timeout_s = idle_timeout_s
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._watchdog: asyncio.Task[None] | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        body = (
            request.content
            if isinstance(request.stream, httpx.ByteStream)
            else await request.aread()
        )
        head = self._head(request, body)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        conn = await self._connection(timeouts.get("connect"))
        self._busy.add(conn)
        conn.transport.write(head + body if len(body) < 65536 else head)  # type: ignore[union-attr]
        if len(body) >= 65536:
            conn.transport.write(body)  # type: ignore[union-attr]
        read_timeout = timeouts.get("read")
        while not conn.headers_done:
            if conn.error is not None:
                self.release(conn, False)
                raise conn.error
            try:
                await conn.wait(read_timeout)
            except BaseException:
                self.release(conn, False)
                raise
        return httpx.Response(
            conn.parser.get_status_code(),
            headers=conn.headers,
            stream=_Body(conn, self, read_timeout),
            extensions={"http_version": b"HTTP/1.1"},
        )

    @staticmethod
    def _head(request: httpx.Request, body: bytes) -> bytes:
        url = request.url
        target = url.raw_path
        lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
        has_length = False
        for name, value in request.headers.raw:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
            elif lower == b"transfer-encoding":
                continue
            lines.append(name + b": " + value)
        if not has_length:
            lines.append(b"content-length: " + str(len(body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _connection(self, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            if self.idle_timeout_s is not None and (
                loop.time() - conn.idle_since > self.idle_timeout_s
            ):
                conn._abort()  # the rest of the stack is older still (LIFO): drop it too
                for old in self._idle:
                    old._abort()
                self._idle.clear()
                break
            conn._reset()
            return conn
        try:
            async with asyncio.timeout(timeout):
                if self.uds is not None:
                    _, conn = await loop.create_unix_connection(_Connection, self.uds)
                else:
                    _, conn = await loop.create_connection(
                        _Connection,
                        self.host,
                        self.port,
                        ssl=self.ssl,
                        server_hostname=self.server_hostname,
                    )
        except TimeoutError:
            raise httpx.ConnectTimeout("connecting to the server timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        return conn

    async def _watch(self) -> None:
        """One timer for every read deadline: cheaper than a timeout context per read."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            now = loop.time()
            for conn in list(self._busy):
                conn.expire(now)

    def release(self, conn: _Connection, reusable: bool) -> None:
        self._busy.discard(conn)
        if reusable and not conn.closed and len(self._idle) < MAX_IDLE:
            conn.parser = httptools.HttpResponseParser(conn)
            if self.idle_timeout_s is not None:
                conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        elif not conn.closed:
            conn._abort()

    async def aclose(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for conn in [*self._idle, *self._busy]:
            conn._abort()
        self._idle.clear()
        self._busy.clear()
