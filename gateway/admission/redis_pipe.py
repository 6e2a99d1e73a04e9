"""One pipelined Redis connection for the admission hot path (the limiter's two scripts).

redis-py spends about 150 us of CPU on every command it sends (a pool checkout under a lock,
the retry wrapper, an ``asyncio.timeout`` around the read, event dispatch on release): more
than the gateway's whole JSON handling, twice per request. :class:`RedisPipe` sends commands
over one keep-alive connection with no per-call machinery: each call appends its encoded
command to a write buffer and a future to a FIFO; the buffer goes out once per event-loop pass
(every admission and settlement queued in that pass shares one write, and Redis answers them
from one read), and replies, parsed by hiredis, resolve the futures in order.

Failures keep redis-py's exception types, so admission classifies them as before:

* connection refused, reset or lost: :class:`redis.exceptions.ConnectionError` (every command
  waiting on that connection gets it; the next call reconnects);
* no reply within ``timeout_s`` (or no connection within ``connect_timeout_s``):
  :class:`redis.exceptions.TimeoutError`, and the connection is dropped (a late reply could no
  longer be matched to its command);
* an error reply: :class:`redis.exceptions.ResponseError` for that command only.

A TLS Redis (``rediss://``), a Redis Cluster and a Redis behind Sentinel are not supported
here: :meth:`RedisPipe.from_client` answers None for them and the limiter stays on redis-py,
which follows TLS, MOVED/ASK redirections and failovers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any, cast

import hiredis
import redis.exceptions
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection, UnixDomainSocketConnection

DEFAULT_TIMEOUT_S = 1.0


def encode_command(args: tuple[Any, ...]) -> bytes:
    """RESP encoding of one command (str, bytes, int or float arguments).

    hiredis's C encoder writes the same bytes (strings as UTF-8, numbers as ``repr``) about
    three times faster; it refuses what it does not know (a bool, an int or float subclass),
    which the Python encoding below then writes or refuses as it always has (it also takes a
    ``memoryview`` as bytes, which no caller sends)."""
    try:
        return hiredis.pack_command(args)  # type: ignore[no-any-return]
    except TypeError:
        return _encode_command(args)


def _encode_command(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        kind = type(arg)  # exact types first: one lookup for the common arguments
        if kind is str:
            data = arg.encode()
        elif kind is bytes:
            data = arg
        elif kind is int or kind is float:
            data = repr(arg).encode()
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int | float):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send a {type(arg).__name__} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Wire(asyncio.Protocol):
    """The socket side of a :class:`RedisPipe`: feeds replies to it, reports a lost socket."""

    def __init__(self, pipe: RedisPipe, loop: asyncio.AbstractEventLoop) -> None:
        self.pipe = pipe
        self.reader = hiredis.Reader(replyError=redis.exceptions.ResponseError)
        self.transport: asyncio.Transport | None = None
        # the loop the socket lives on, kept: get_running_loop() asks the OS for the process
        # id on every call (Python 3.11), and every command needs the loop
        self.loop = loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        pending = self.pipe._pending
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.pipe._drop(self, redis.exceptions.ConnectionError(f"bad reply: {exc}"))
                return
            if reply is False:
                return
            if not pending:  # a reply nobody waits for: the stream is out of step
                self.pipe._drop(self, redis.exceptions.ConnectionError("unexpected reply"))
                return
            future, _ = pending.popleft()
            if not future.done():
                if isinstance(reply, redis.exceptions.ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe._drop(
            self,
            redis.exceptions.ConnectionError(
                f"Connection to Redis lost ({exc or 'closed by the server'})"
            ),
        )


class RedisPipe:
    """A pipelined connection to one Redis; safe to share across the tasks of one event loop.

    Calls never wait for each other: many can be in flight on the one connection. It connects
    on first use and again after a failure; :meth:`aclose` closes it.
    """

    def __init__(
        self,
        *,
        path: str | None = None,
        host: str = "localhost",
        port: int = 6379,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._path = path
        self._host = host
        self._port = port
        self._hello: list[tuple[Any, ...]] = []
        if password is not None:
            self._hello.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            self._hello.append(("SELECT", db))
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._wire: _Wire | None = None
        self._connecting: asyncio.Future[_Wire] | None = None
        self._pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._closed = False

    @classmethod
    def from_client(cls, client: Redis | RedisCluster) -> RedisPipe | None:
        """A pipe to the Redis ``client`` talks to, with its credentials, database and socket
        timeouts; None when the client connects in a way the pipe does not: TLS, a Redis
        Cluster (a key's node changes with MOVED/ASK) or Sentinel (the master changes with a
        failover). redis-py's client follows those; the limiter stays on it."""
        if not isinstance(client, Redis):
            return None
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        common: dict[str, Any] = {
            "username": kwargs.get("username"),
            "password": kwargs.get("password"),
            "db": int(kwargs.get("db") or 0),
            "timeout_s": kwargs.get("socket_timeout") or DEFAULT_TIMEOUT_S,
            "connect_timeout_s": (
                kwargs.get("socket_connect_timeout")
                or kwargs.get("socket_timeout")
                or DEFAULT_TIMEOUT_S
            ),
        }
        if pool.connection_class is UnixDomainSocketConnection:
            return cls(path=kwargs["path"], **common)
        if pool.connection_class is Connection:
            return cls(
                host=kwargs.get("host", "localhost"), port=int(kwargs.get("port", 6379)), **common
            )
        return None

    # ------------------------------------------------------------------ commands

    async def execute(self, *args: Any) -> Any:
        """Send one command; its reply (hiredis types: bytes, int, list, None)."""
        wire = self._wire
        if wire is None:
            wire = await self._connect()
        return await self._send(wire, encode_command(args))

    async def execute_many(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write; their replies in order. The first error reply is
        raised once every reply is in (the other commands ran: Redis does not stop a
        pipeline at an error, as redis-py's ``pipeline(transaction=False)`` does not)."""
        if not commands:
            return []
        wire = self._wire
        if wire is None:
            wire = await self._connect()
        futures = [self._send(wire, encode_command(command)) for command in commands]
        # replies resolve their futures in order, and a lost connection fails them all at
        # once: when the last is done, every one is
        with contextlib.suppress(redis.exceptions.RedisError):
            await futures[-1]
        error: BaseException | None = None
        results = []
        for future in futures:  # every error retrieved: none is logged as forgotten
            exc = future.exception()
            error = error or exc
            results.append(exc or future.result())
        if error is not None:
            raise error
        return results

    async def evalsha(
        self, sha: str, source: str, keys: tuple[str, ...] | list[str], args: list[Any]
    ) -> Any:
        """EVALSHA, falling back to EVAL (which caches the script) when Redis lacks it."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.execute("EVAL", source, len(keys), *keys, *args)

    async def aclose(self) -> None:
        """Close the connection; commands still waiting get a ConnectionError."""
        self._closed = True
        if self._wire is not None:
            self._drop(self._wire, redis.exceptions.ConnectionError("the pipe was closed"))

    # ------------------------------------------------------------------ internals

    def _send(self, wire: _Wire, command: bytes) -> asyncio.Future[Any]:
        """Queue ``command`` on ``wire`` (the current connection); its reply's future."""
        loop = wire.loop
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((future, loop.time() + self._timeout_s))
        self._out.append(command)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._timeout_s, self._check_timeouts)
        return future

    def _flush(self) -> None:
        self._flush_scheduled = False
        wire = self._wire
        if self._out and wire is not None and wire.transport is not None:
            data, self._out = b"".join(self._out), []
            wire.transport.write(data)

    def _check_timeouts(self) -> None:
        self._watchdog = None
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        oldest = self._pending[0][1]
        if oldest <= loop.time():
            if self._wire is not None:
                self._drop(self._wire, redis.exceptions.TimeoutError("Timeout reading from Redis"))
            return
        self._watchdog = loop.call_at(oldest, self._check_timeouts)

    def _drop(self, wire: _Wire, exc: Exception) -> None:
        """Forget ``wire`` (if still current) and fail every command waiting on it."""
        if wire is not self._wire:
            return
        self._wire = None
        self._out.clear()
        pending, self._pending = self._pending, collections.deque()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if wire.transport is not None:
            wire.transport.abort()
        for future, _ in pending:
            if not future.done():
                future.set_exception(exc)

    async def _connect(self) -> _Wire:
        if self._closed:
            raise redis.exceptions.ConnectionError("the pipe was closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, future: asyncio.Future[_Wire]) -> None:
        self._connecting = None
        if not future.cancelled():
            future.exception()  # retrieved: every waiter gets it through the shield

    async def _open(self) -> _Wire:
        loop = asyncio.get_running_loop()
        wire = _Wire(self, loop)
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if self._path is not None:
                    await loop.create_unix_connection(lambda: wire, self._path)
                else:
                    await loop.create_connection(lambda: wire, self._host, self._port)
        except TimeoutError as exc:
            raise redis.exceptions.TimeoutError("Timeout connecting to Redis") from exc
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"Cannot connect to Redis: {exc}") from exc
        self._wire = wire
        try:
            for command in self._hello:
                await self._send(wire, encode_command(command))
        except BaseException:
            self._drop(wire, redis.exceptions.ConnectionError("Redis refused the handshake"))
            raise
        return wire


def script_sha(source: str) -> str:
    """The SHA1 Redis names a script by."""
    return hashlib.sha1(source.encode()).hexdigest()
