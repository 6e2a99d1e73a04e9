"""A lean HTTP/1.1 client transport: the gateway's engines (Unix socket or TCP) and its
OpenAI-compatible remote upstreams (TCP, optionally TLS).

The gateway keeps one connection pool per engine replica or remote endpoint; this is it.
httpcore, httpx's default, spends about a millisecond of CPU per request in its connection
state machine and anyio layers, which is the whole overhead budget of the gateway; this
transport parses responses with ``httptools`` (the parser uvicorn uses) on a plain asyncio
protocol and costs a small fraction of that.

Two doors to the same pool. The proxy's hot path calls :meth:`LeanTransport.request` with the
request head already written as bytes (:func:`request_head`, from the engine-hop headers) and
gets a :class:`LeanResponse`: the status, the raw headers and the body stream, no httpx
``Request``, ``Headers`` or ``Response`` built (URL parsing and header normalisation cost
about 14% of the gateway's event loop when they were). Everything else (health probes, the
prefix index's polls, a remote's ``httpx.AsyncClient``) uses it as an httpx transport
(:meth:`LeanTransport.handle_async_request`), which wraps the same call in httpx's models.

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
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

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
        # kept: get_running_loop() asks the OS for the process id on every call (Python 3.11)
        self.loop = asyncio.get_running_loop()

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

    def on_body(self, body: bytes) -> None:  # once per chunk of a chunked answer: kept lean
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter  # _wake, inline
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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
        loop = self.loop
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


class LeanResponse:
    """An answer whose head has arrived: ``status_code``, the ``headers`` as the server sent
    them (raw name/value bytes), and the body, read whole (:meth:`read`) or as it arrives
    (:meth:`aiter_raw`, undecoded). :meth:`aclose` must be awaited once, on every path: it
    gives the connection back to the pool when the body was read to its end, else closes it.
    """

    __slots__ = ("status_code", "headers", "_conn", "_pool", "_timeout", "_done", "_released")

    def __init__(
        self,
        status_code: int,
        headers: list[tuple[bytes, bytes]],
        conn: _Connection,
        pool: LeanTransport,
        timeout: float | None,
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self._conn = conn
        self._pool = pool
        self._timeout = timeout
        self._done = False
        self._released = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    @property
    def finished(self) -> bool:
        """Whether the body has been read to its end (nothing more will come)."""
        return self._done

    async def receive(self) -> bytes | None:
        """The body bytes received since the last call (undecoded, chunk framing removed),
        waiting for some; None at the end. Bytes that end the body set :attr:`finished`, so a
        reader that has them all knows it without another call."""
        conn = self._conn
        while True:
            if conn.chunks:
                data = conn.take()
                if conn.complete:
                    self._done = True
                return data
            if conn.complete:
                self._done = True
                return None
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk framing removed, content encoding kept."""
        while (data := await self.receive()) is not None:
            yield data

    async def read(self) -> bytes:
        """The whole body, decoded when the server sent it content-encoded."""
        parts = []
        while (data := await self.receive()) is not None:
            parts.append(data)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if body and self.header(b"content-encoding") is not None:
            decoded = httpx.Response(self.status_code, headers=self.headers, content=body)
            return decoded.content  # httpx's decoders (gzip, deflate, br, zstd)
        return body

    async def aclose(self) -> None:
        if not self._released:  # a connection goes back to the pool once, never twice
            self._released = True
            self._pool.release(self._conn, self._done and self._conn.keep_alive)


class _Body(httpx.AsyncByteStream):
    """A :class:`LeanResponse`'s body as httpx's stream (the httpx adapter)."""

    def __init__(self, answer: LeanResponse) -> None:
        self.answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self.answer.aiter_raw():
            yield data

    async def aclose(self) -> None:
        await self.answer.aclose()


class UpstreamAnswer(Protocol):
    """What the proxy reads of an upstream's answer: a :class:`LeanResponse`, or an httpx
    response behind the same calls (:class:`HttpxAnswer`). ``receive`` gives the raw body
    as it arrives (None at its end); ``finished`` says the end was reached."""

    status_code: int

    @property
    def finished(self) -> bool: ...

    def header(self, name: bytes) -> bytes | None: ...

    async def read(self) -> bytes: ...

    async def receive(self) -> bytes | None: ...

    async def aclose(self) -> None: ...


class HttpxAnswer:
    """An ``httpx.Response`` as an :class:`UpstreamAnswer`: replicas whose transport is not
    this one (httpx's HTTP/2 transport for a remote, in-process test transports). It learns
    that its body ended only from the read that finds nothing more (``finished``)."""

    __slots__ = ("response", "status_code", "finished", "_raw")

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.finished = False
        self._raw: AsyncIterator[bytes] | None = None

    def header(self, name: bytes) -> bytes | None:
        values = self.response.headers.get_list(name.decode("ascii"))
        return values[0].encode(self.response.headers.encoding) if values else None

    async def read(self) -> bytes:
        return await self.response.aread()

    async def receive(self) -> bytes | None:
        if self._raw is None:
            self._raw = self.response.aiter_raw()
        async for data in self._raw:
            if data:
                return data
        self.finished = True
        return None

    async def aclose(self) -> None:
        await self.response.aclose()


def header_text(value: bytes | None, default: str) -> str:
    """A header value as text (UTF-8, else Latin-1, as httpx decodes them), or ``default``."""
    if value is None:
        return default
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def request_start(method: str, url: httpx.URL) -> str:
    """The request line and ``host`` header of ``method url``, as httpx writes them; a
    caller keeps it per URL and hands it to :func:`request_head` for every request."""
    target = url.raw_path.decode("ascii")
    return f"{method} {target} HTTP/1.1\r\nhost: {url.netloc.decode('ascii')}\r\n"


def request_head(start: str, headers: Mapping[str, str], body_length: int) -> bytes:
    """The whole head of a request: ``start`` (:func:`request_start`), ``headers`` (lower-case
    names; any ``content-length`` or ``transfer-encoding`` among them is dropped) and the
    body's length. Values are ASCII, as httpx requires of a ``str`` header value."""
    if "content-length" in headers or "transfer-encoding" in headers:
        headers = {
            k: v for k, v in headers.items() if k not in ("content-length", "transfer-encoding")
        }
    lines = "\r\n".join(map(": ".join, headers.items()))
    if lines:
        lines += "\r\n"
    return f"{start}{lines}content-length: {body_length}\r\n\r\n".encode("ascii")


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
        self._loop: asyncio.AbstractEventLoop | None = None  # set with the watchdog

    async def request(
        self, head: bytes, body: bytes, timeouts: Mapping[str, float | None]
    ) -> LeanResponse:
        """Send one request (``head`` from :func:`request_head`, then ``body``) and wait for
        the answer's head. ``timeouts``: httpx's timeout mapping (``connect``, ``read``).

        Raises ``httpx.ConnectError`` / ``ConnectTimeout`` before anything is written,
        ``RemoteProtocolError`` / ``ReadTimeout`` after; the connection is freed on every path
        that raises (a cancellation included), else by :meth:`LeanResponse.aclose`.
        """
        if self._watchdog is None:
            self._loop = asyncio.get_running_loop()
            self._watchdog = self._loop.create_task(self._watch())
        conn = await self._connection(timeouts.get("connect"))
        self._busy.add(conn)
        transport: asyncio.Transport = conn.transport  # type: ignore[assignment]  # connected
        if len(body) < 65536:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)
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
        return LeanResponse(conn.parser.get_status_code(), conn.headers, conn, self, read_timeout)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface (health probes, the prefix index's polls, clients that
        hold this transport): the same :meth:`request`, with httpx's models around it."""
        body = (
            request.content
            if isinstance(request.stream, httpx.ByteStream)
            else await request.aread()
        )
        answer = await self.request(
            self._head(request, body), body, request.extensions.get("timeout", {})
        )
        return httpx.Response(
            answer.status_code,
            headers=answer.headers,
            stream=_Body(answer),
            extensions={"http_version": b"HTTP/1.1"},
        )

    @staticmethod
    def _head(request: httpx.Request, body: bytes) -> bytes:
        lines = [request.method.encode() + b" " + request.url.raw_path + b" HTTP/1.1"]
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
        loop = self._loop or asyncio.get_running_loop()  # kept with the watchdog
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
                conn.idle_since = conn.loop.time()
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
