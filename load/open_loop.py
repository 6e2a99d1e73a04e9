"""A lean HTTP/1.1 load generator for the gateway benchmark.

httpx spends more CPU per request than the gateway we want to measure, so this generator
speaks HTTP/1.1 itself on keep-alive asyncio streams: requests are prepared as raw bytes once
(:func:`build_request`), and each answer is read just far enough to time it (status line,
headers, then the ``Content-Length`` body or every chunk of a chunked one).

Two ways to drive load:

* :func:`open_loop` sends at a fixed rate whatever happens to earlier requests (latency at a
  given load, no coordinated omission: a slow answer never delays the next send);
* :func:`closed_loop` keeps ``concurrency`` requests in flight for a while (the generator's own
  ceiling, or a server's saturation throughput).

Every answer becomes a :class:`Sample`: status, time to the first body chunk (the first SSE
event for streams), time to the end, and how late the send was against its schedule.

While either loop runs, everything the generator process held before it is frozen out of the
cyclic garbage collector (:func:`generator_gc`): a full collection over a benchmark process's
heap (its earlier samples, httpx, the report code) stalls the generator for 20-120 ms, and every
answer in flight then looks that much slower, whichever server it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shot:
    """One prepared request: its raw bytes and what to group its sample under."""

    label: str  # e.g. "json" or "stream": latencies are compared per label
    tenant: str
    raw: bytes


@dataclass(slots=True)
class Sample:
    """How one request went. Times are seconds from the moment its bytes were written."""

    label: str
    tenant: str
    status: int  # 0: no HTTP answer (connection error)
    first_s: float = 0.0  # first body chunk (non-streaming: the whole body)
    total_s: float = 0.0
    lag_s: float = 0.0  # send time minus scheduled time (open loop only)
    overhead_ms: float | None = None  # the gateway's own x-portico-overhead-ms, when present
    error: str = ""


def build_request(
    host: str,
    path: str,
    body: Mapping[str, Any],
    api_key: str | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> bytes:
    """The raw bytes of ``POST path`` with a JSON body (keep-alive)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
    ]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    lines += [f"{k}: {v}" for k, v in (extra_headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in a lower-cased response head."""
    start = head.find(b"\r\n" + name + b":")
    if start < 0:
        return None
    start += len(name) + 3
    end = head.find(b"\r\n", start)
    return head[start:end].strip()


class Connection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reusable = True

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        return cls(reader, writer)

    def close(self) -> None:
        self.reusable = False
        self.writer.close()

    async def send(self, shot: Shot, sample: Sample) -> None:
        """Write ``shot`` and read its whole answer into ``sample``."""
        start = time.perf_counter()
        self.writer.write(shot.raw)
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        sample.status = int(head[9:12])
        overhead = _header(head, b"x-portico-overhead-ms")
        if overhead is not None:
            sample.overhead_ms = float(overhead)
        if _header(head, b"transfer-encoding") == b"chunked":
            first = 0.0
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                if not first:
                    first = time.perf_counter()
        else:
            await self.reader.readexactly(int(_header(head, b"content-length") or 0))
            first = time.perf_counter()
        end = time.perf_counter()
        sample.first_s = first - start if first else end - start
        sample.total_s = end - start
        if _header(head, b"connection") == b"close":
            self.close()


class ConnectionPool:
    """Idle keep-alive connections to one address, opened on demand."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[Connection] = []

    async def send(self, shot: Shot, sample: Sample) -> None:
        conn = None
        try:
            conn = self.idle.pop() if self.idle else await Connection.open(self.host, self.port)
            await conn.send(shot, sample)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            if conn is not None:
                conn.close()
            sample.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        except asyncio.CancelledError:  # timed out mid-answer: the connection is unusable
            if conn is not None:
                conn.close()
            raise
        if conn.reusable:
            self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


@contextlib.contextmanager
def generator_gc() -> Iterator[None]:
    """Collect now, then freeze what exists, so that collections during a run only scan the
    objects the run itself creates (a few thousand: short pauses, not the heap's). Thawed after.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _send_within(pool: ConnectionPool, shot: Shot, sample: Sample, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(pool.send(shot, sample), timeout_s)
    except asyncio.TimeoutError:
        sample.status = 0
        sample.error = f"no full answer in {timeout_s:g} s"


async def open_loop(
    host: str,
    port: int,
    shots: Sequence[Shot],
    rate: float,
    num_requests: int,
    gaps: Sequence[float] | None = None,
    timeout_s: float = 30.0,
) -> list[Sample]:
    """Send ``num_requests`` (cycling through ``shots``) at ``rate`` per second.

    ``gaps`` (seconds before each send, e.g. :func:`load.datasets.arrival_gaps`) replaces the
    even spacing. A request without its full answer after ``timeout_s`` counts as failed
    (status 0), so an overloaded server cannot stall the run. Samples come in send order.
    """
    if rate <= 0 or not shots:
        raise ValueError("open_loop needs a positive rate and at least one shot")
    pool = ConnectionPool(host, port)
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    with generator_gc():
        start = time.perf_counter()
        scheduled = start
        for i in range(num_requests):
            shot = shots[i % len(shots)]
            scheduled = scheduled + gaps[i] if gaps is not None else start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sample = Sample(shot.label, shot.tenant, 0, lag_s=time.perf_counter() - scheduled)
            samples.append(sample)
            tasks.append(asyncio.create_task(_send_within(pool, shot, sample, timeout_s)))
        await asyncio.gather(*tasks)
    pool.close()
    return samples


async def closed_loop(
    host: str,
    port: int,
    shots: Sequence[Shot],
    concurrency: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
) -> tuple[list[Sample], float]:
    """Keep ``concurrency`` requests in flight until ``duration_s`` passed or ``num_requests``
    were sent (whichever is given; both: the first reached). Returns (samples, seconds)."""
    if duration_s is None and num_requests is None:
        raise ValueError("closed_loop needs duration_s or num_requests")
    if concurrency < 1 or not shots:
        raise ValueError("closed_loop needs concurrency >= 1 and at least one shot")
    samples: list[Sample] = []
    budget = num_requests if num_requests is not None else -1
    start = deadline = 0.0

    async def worker(first: int) -> None:
        nonlocal budget
        pool = ConnectionPool(host, port)
        i = first
        while time.perf_counter() < deadline and budget != 0:
            budget -= 1
            shot = shots[i % len(shots)]
            i += concurrency
            sample = Sample(shot.label, shot.tenant, 0)
            samples.append(sample)
            await pool.send(shot, sample)
        pool.close()

    with generator_gc():
        start = time.perf_counter()
        deadline = start + duration_s if duration_s is not None else float("inf")
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    return samples, elapsed


def run_async(coro: Any) -> Any:
    """Run a coroutine on uvloop when it is installed (it is, with uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
