"""The engine for the server: the blocking step loop in a thread, one async stream per request.

The asyncio loop never runs a model step. A dedicated thread owns the :class:`LLMEngine`
(which is not thread-safe): it takes new requests and aborts from a command queue at each step
boundary, runs ``step()``, and hands each :class:`RequestOutput` back to the asyncio loop with
``loop.call_soon_threadsafe`` into the request's own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import ParameterError
from engine.stats import EngineStats, StatsLogger
from engine.tenancy import TenantTag


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crash or shutdown); the request cannot finish."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: Any
    priority: int
    cache_salt: str | None
    arrival_time: float
    lora_request: Any = None
    tenant: TenantTag | None = None
    mm_inputs: tuple[Any, ...] = ()  # engine.multimodal.ImageInput


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """Serves many concurrent async callers from one engine thread.

    Promises: ``generate`` raises ValueError at call time for bad input (nothing queued, nothing
    allocated); each request's stream yields cumulative :class:`RequestOutput` objects in
    order and ends after the one with ``finished=True``; leaving the stream early (break,
    cancellation, client disconnect) aborts the request, whose blocks are freed at the next step
    boundary. ``is_alive`` turns False if the loop crashes; ``last_progress`` is the monotonic
    time the last step returned, or of the last moment the loop was idle (an idle engine is not
    a stuck one).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.config = engine.config
        self.numerics = engine.numerics
        self.last_progress = time.monotonic()
        self._commands: deque[_Add | _Abort] = deque()
        self._wakeup = threading.Condition()
        # request_id -> (its queue, its arrival time): outputs of an earlier request that
        # used the same id (aborted, not yet reaped) carry another arrival time and are dropped.
        self._streams: dict[str, tuple[asyncio.Queue[RequestOutput | BaseException], float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._stats_logger = StatsLogger()

    @classmethod
    def from_config(cls, config: Any) -> AsyncLLMEngine:
        return cls(LLMEngine.from_config(config))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="portico-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop after the current step; unfinished streams raise EngineDeadError."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self._fail_all(EngineDeadError("the engine is shutting down"))

    @property
    def is_alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._error is None
            and not self._stopping
        )

    @property
    def num_unfinished(self) -> int:
        """Requests with an open stream (what a draining server waits for)."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The snapshot taken at the end of the latest step (cheap, never blocks)."""
        return self._stats

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
        tenant: TenantTag | None = None,
        mm_inputs: tuple[Any, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its output stream. ValueError on bad input.

        ``tenant`` (None: the default tenant) is whom the scheduler charges for it."""
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been awaited")
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if request_id in self._streams:
            raise ParameterError("request_id", f"request_id {request_id!r} is already running")
        self.engine.check_request(prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        arrival = time.monotonic()
        self._streams[request_id] = (queue, arrival)
        self._send(
            _Add(
                request_id, list(prompt_token_ids), params, priority, cache_salt, arrival,
                lora_request, tenant, mm_inputs,
            )
        )  # fmt: skip
        return self._stream(request_id, queue)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with ``finish_reason="abort"`` if still open."""
        if request_id in self._streams:
            self._send(_Abort(request_id))

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(_Abort(request_id))
            entry = self._streams.get(request_id)
            if entry is not None and entry[0] is queue:
                del self._streams[request_id]

    # ------------------------------------------------------------------ engine thread

    def _send(self, command: _Add | _Abort) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while (
                        not self._stopping
                        and not self._commands
                        and not self.engine.has_unfinished()
                    ):
                        self.last_progress = time.monotonic()
                        self._wakeup.wait(timeout=1.0)
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                self._apply(commands)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                self._stats = self.engine.stats()
                self._stats_logger.observe(self._stats)
                # A step that returned is progress (a prefill chunk yields no output); a hung
                # step never returns, which is what a stall check must see.
                self.last_progress = time.monotonic()
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:  # the loop must report, not vanish
            self._error = exc
            self._call_soon(self._fail_all, EngineDeadError(f"engine loop crashed: {exc!r}"))

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        aborted: list[RequestOutput] = []
        for cmd in commands:
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        priority=cmd.priority,
                        cache_salt=cmd.cache_salt,
                        arrival_time=cmd.arrival_time,
                        lora_request=cmd.lora_request,
                        tenant=cmd.tenant,
                        mm_inputs=cmd.mm_inputs,
                    )
                except ValueError as exc:  # validated before queueing; kept for safety
                    self._call_soon(self._put, cmd.request_id, exc)
            else:
                out = self.engine.abort(cmd.request_id)
                if out is not None:
                    aborted.append(out)
        if aborted:
            self._deliver(aborted)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One hand-off per step, not one per request: each call_soon_threadsafe writes to the
        # loop's wake-up pipe, and at 64 streams those writes and wake-ups add up.
        self._call_soon(self._put_all, outputs)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # ------------------------------------------------------------------ asyncio side

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._put(out.request_id, out)

    def _put(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        queue, arrival = entry
        if isinstance(item, RequestOutput) and item.metrics.arrival_time != arrival:
            return  # the end of an earlier request with the same id
        queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        for queue, _ in self._streams.values():
            queue.put_nowait(exc)
