"""Engine requests as the HTTP layer sees them: iterate, merge, release, survive disconnects.

Every path that can end a response early — a client that leaves before the first byte, during
a stream or while waiting for a non-streaming answer, an error midway — ends in an abort of the
engine request, so its KV blocks are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.outputs import RequestOutput
from engine.server import sse
from engine.server.metrics import ServerMetrics
from portico.errors import ServiceUnavailableError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class EngineRequest:
    """One queued engine request: iterate it once for its outputs; ``close()`` releases it.

    Leaving the iteration early, or closing a request that was never iterated (the client left
    before the response started), aborts it in the engine. Metrics are fed as outputs arrive.
    ``background`` holds the release tasks so they are not garbage-collected mid-flight.
    """

    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: ServerMetrics,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        num_prompt_tokens: int,
        num_choices: int,
        background: set[asyncio.Task[None]],
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.num_choices = num_choices
        self.background = background
        self.started = False
        self.finished = False
        self.closed = False
        self.tracker = metrics.track(num_prompt_tokens)  # latencies count from submission

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        self.started = True
        tracker = self.tracker
        try:
            async for output in self.stream:
                tracker.observe(output)
                self.finished = output.finished
                if any(c.finish_reason == "abort" for c in output.outputs):
                    raise ServiceUnavailableError(
                        "The request was aborted by the engine (it is shutting down).",
                        code="request_aborted",
                    )
                yield output
        except EngineDeadError:
            raise ServiceUnavailableError(
                "The engine stopped while generating this response.", code="engine_dead"
            ) from None
        finally:
            tracker.finish(self.num_choices)
            if not self.finished:
                await self.engine.abort(self.request_id)
                with contextlib.suppress(Exception):
                    await self.stream.aclose()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Release the request if it has not finished (idempotent, safe from any path).

        A request never iterated is aborted and its stream drained here; one abandoned midway
        is aborted too, without waiting for its iterator to be garbage-collected.
        """
        if self.finished or self.closed:
            return
        self.closed = True
        if self.started:
            work: Awaitable[None] = self.engine.abort(self.request_id)
        else:
            self.started = True
            self.tracker.finish(self.num_choices)
            work = self._abort_and_drain()
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _abort_and_drain(self) -> None:
        # The engine forgets a request only once its stream has been read to the end.
        await self.engine.abort(self.request_id)
        with contextlib.suppress(Exception):
            async for _ in self.stream:
                pass


async def merge(requests: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come: (request index, output)."""
    if len(requests) == 1:
        async for out in requests[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, engine_request: EngineRequest) -> None:
        try:
            async for out in engine_request:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine_request in requests:
            engine_request.close()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await ``work``, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that releases its engine requests however the response ends."""

    def __init__(self, content: AsyncIterator[bytes], requests: list[EngineRequest]) -> None:
        super().__init__(content, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.engine_requests = requests

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            for engine_request in self.engine_requests:
                engine_request.close()
