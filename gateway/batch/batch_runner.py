"""The batch runner: feeds batch lines through the gateway's own request path, at the
``batch`` priority class, a bounded number at a time, and survives a restart.

Each line is sent to the same function an interactive request takes after authentication
(:meth:`gateway.request_path.Gateway.serve`) with the batch owner's principal, its plan's
scheduling share turned to the ``batch`` class: it is routed, admitted (rate limits, the token
quota and the money budget), forwarded, and settled with its exact usage as the same request
sent interactively. A refused admission for a rate or concurrency limit waits and tries again
(the line was never run); a spent quota or budget, a bad parameter or an engine error goes to
the error file with the line's own error.

Progress is recorded per line in Redis (:class:`~gateway.batch.batches.BatchStore`), the
line's result written once. A gateway that stops (SIGTERM) sends no new line, lets the lines in
flight finish and record, and gives up its lease; the next gateway (or another replica, once a
dead runner's lease expires) resumes with the lines that have no result: none is run twice,
none is lost. A runner killed outright loses the answers of the lines it had in flight (the
engine aborts them when the connection drops); those lines have no result and run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.responses import Response

from gateway.admission.admission import BudgetExceededError, LimitExceededError
from gateway.batch.batches import (
    BATCH_ENDPOINTS,
    TERMINAL,
    BatchLine,
    BatchSettings,
    BatchStore,
    LineError,
    batch_model,
    error_line,
    output_line,
    parse_line,
    read_lines,
)
from gateway.batch.files import FileStorageError, FileStore
from gateway.identity.principal import Principal
from gateway.identity.tenants import TenantStore
from gateway.relay.proxy import RelayResponse
from gateway.relay.request_context import RequestContext
from portico.errors import APIError, AuthenticationError, ServiceUnavailableError, error_body

log = logging.getLogger("portico.gateway.batches")

STATUS_POLL_S = 1.0  # how often a running batch looks for a cancel made on any replica
RETRY_PAUSE_S = 1.0  # after a 503 (no replica ready): the line waits, then tries again


class LineServer(Protocol):
    """The gateway's request path from an authenticated principal on (Gateway.serve)."""

    def __call__(
        self, principal: Principal, raw: bytes, kind: str, path: str, ctx: RequestContext
    ) -> Awaitable[Response]: ...


async def owner_principal(tenants: TenantStore, tenant_id: str, owner: dict[str, Any]) -> Principal:
    """The batch owner's principal as it is now (a revoked key or a disabled tenant stops its
    batches), at the ``batch`` priority class."""
    tenant = await tenants.get_tenant(tenant_id)
    if tenant is None or tenant.disabled:
        raise AuthenticationError(
            "The tenant that created this batch no longer exists or is disabled."
        )
    key = None
    if owner.get("key_id"):
        key = await tenants.get_key(tenant_id, owner["key_id"])
        if not key.is_active(time.time()):
            raise AuthenticationError("The API key that created this batch was revoked or expired.")
    principal = tenants.principal_for(tenant, key, subject=owner.get("subject"))
    share = dataclasses.replace(principal.share, priority_class="batch")
    return dataclasses.replace(principal, share=share)


class BatchRunner:
    """Runs the queued batches this gateway holds the lease of; one task per batch, lines in
    flight bounded by ``settings.max_concurrency`` over all of them."""

    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        settings: BatchSettings,
        serve: LineServer,
        principal_of: Callable[[str, dict[str, Any]], Awaitable[Principal]],
        draining: Callable[[], bool],
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.store = store
        self.files = files
        self.settings = settings
        self.serve = serve
        self.principal_of = principal_of
        self.draining = draining
        self.stop_timeout_s = stop_timeout_s
        self.owner = f"{os.uname().nodename}:{os.getpid()}:{os.urandom(4).hex()}"
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._lines: set[asyncio.Task[None]] = set()  # every line in flight
        self._wake = asyncio.Event()
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._scan())

    def wake(self) -> None:
        """Look at the queue now (a batch was created or cancelled here)."""
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stopping or self.draining()

    async def stop(self) -> None:
        """Send no new line; let the lines in flight finish and record (for up to
        ``stop_timeout_s``: a line cut short then has no result and runs again on resume);
        give up the leases."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        waiting = {*self._lines, *self._running.values()}
        if not waiting:
            return
        _, late = await asyncio.wait(waiting, timeout=self.stop_timeout_s)
        if late:
            log.warning("batch runner: %d task(s) cut short by the stop timeout", len(late))
        for task in late:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    async def _scan(self) -> None:
        while not self.stopping:
            try:
                for tenant_id, batch_id in await self.store.queued():
                    if self.stopping or (tenant_id, batch_id) in self._running:
                        continue
                    if await self.store.take_lease(
                        tenant_id, batch_id, self.owner, self.settings.lease_s
                    ):
                        task = asyncio.create_task(self._hold(tenant_id, batch_id))
                        self._running[(tenant_id, batch_id)] = task
            except Exception as exc:  # Redis down: try again on the next scan
                log.warning("reading the batch queue failed: %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.scan_interval_s)

    async def _hold(self, tenant_id: str, batch_id: str) -> None:
        """Run one batch while renewing its lease; give the lease up at the end."""
        run = asyncio.create_task(self._run(tenant_id, batch_id))
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=self.settings.lease_s / 3)
                if not run.done() and not await self.store.take_lease(
                    tenant_id, batch_id, self.owner, self.settings.lease_s
                ):
                    log.warning("batch %s: lease lost; stopping here", batch_id)
                    run.cancel()
            await run
        except asyncio.CancelledError:
            run.cancel()
            raise
        except FileStorageError as exc:  # logged by the storage; an outage, not a bug
            run.cancel()
            log.warning("batch %s: %s It resumes on the next scan.", batch_id, exc.message)
        except Exception:
            run.cancel()
            log.exception("batch %s: the run failed; it resumes on the next scan", batch_id)
        else:
            if not self.stopping:  # the next queued batch starts now
                self.wake()
        finally:
            self._running.pop((tenant_id, batch_id), None)
            with contextlib.suppress(Exception):
                await self.store.drop_lease(tenant_id, batch_id, self.owner)

    async def _run(self, tenant_id: str, batch_id: str) -> None:
        store = self.store
        batch = await store.load(tenant_id, batch_id)
        if batch["status"] in TERMINAL:  # finished, but still queued: a finish cut short
            await store.finish(tenant_id, batch_id)
            return
        now = str(int(time.time()))
        await store.transition(
            tenant_id, batch_id, ("validating",), status="in_progress", in_progress_at=now
        )
        try:
            content = await self.files.content(tenant_id, batch["input_file_id"])
        except FileStorageError:  # the storage is down, not the batch wrong: it resumes
            raise
        except APIError as exc:
            await self._fail(tenant_id, batch_id, exc)
            return
        feed = _Feed(self, tenant_id, batch, read_lines(content))
        try:
            feed.principal = await self.principal_of(tenant_id, batch["owner"])
        except APIError as exc:
            feed.refused = exc  # every line left gets the owner's error
        ending = await feed.run()
        if ending is not None:
            await self._finalize(tenant_id, batch, feed, ending)

    async def _fail(self, tenant_id: str, batch_id: str, exc: APIError) -> None:
        errors = {
            "object": "list",
            "data": [
                {"code": exc.code, "message": exc.message, "param": "input_file_id", "line": None}
            ],
        }
        await self.store.transition(
            tenant_id,
            batch_id,
            ("validating", "in_progress", "cancelling"),
            status="failed",
            failed_at=str(int(time.time())),
            errors=json.dumps(errors),
            counts=json.dumps([0, 0]),
        )
        await self.store.finish(tenant_id, batch_id)

    async def _finalize(
        self, tenant_id: str, batch: dict[str, Any], feed: _Feed, ending: str
    ) -> None:
        """Write the output and error files (input order) and end the batch in ``ending``:
        completed, expired (lines never sent get a ``batch_expired`` error) or cancelled."""
        store, batch_id = self.store, batch["id"]
        moving = ("in_progress", "cancelling", "finalizing")
        if ending == "completed":
            await store.transition(
                tenant_id,
                batch_id,
                moving,
                status="finalizing",
                finalizing_at=str(int(time.time())),
            )
        out, err = await store.results(tenant_id, batch_id)
        if ending == "expired":
            message = "This request could not be executed before the completion window expired."
            for index, custom_id in feed.custom_ids.items():
                if index not in out and index not in err:
                    err[index] = error_line(custom_id, "batch_expired", message)
        hex_id = batch_id.removeprefix("batch_")
        changes: dict[str, Any] = {"status": ending, f"{ending}_at": str(int(time.time()))}
        for name, lines, suffix in (
            ("output_file_id", out, "output"),
            ("error_file_id", err, "errors"),
        ):
            if not lines:
                continue
            text = "".join(lines[i] + "\n" for i in sorted(lines)).encode()
            meta = await self.files.create(
                tenant_id,
                f"{batch_id}_{suffix}.jsonl",
                "batch_output",
                text,
                file_id=f"file-{hex_id}-{suffix}",
            )
            changes[name] = meta["id"]
        changes["counts"] = json.dumps([len(out), len(err)])
        if await store.transition(tenant_id, batch_id, moving, **changes):
            await store.finish(tenant_id, batch_id)
        log.info("batch %s %s: %d answered, %d failed", batch_id, ending, len(out), len(err))


class _Feed:
    """One run over one batch's lines: the lines without a result are checked and sent, at
    most ``max_concurrency`` in flight over the runner. ``run`` says how the batch ends
    (completed, expired or cancelled), or None when the gateway is stopping (it resumes)."""

    def __init__(
        self, runner: BatchRunner, tenant_id: str, batch: dict[str, Any], lines: list[bytes]
    ) -> None:
        self.runner = runner
        self.tenant_id = tenant_id
        self.batch = batch
        self.lines = lines
        self.kind = BATCH_ENDPOINTS[batch["endpoint"]]
        self.custom_ids: dict[int, str | None] = {}
        self.principal: Principal | None = None
        self.refused: APIError | None = None
        self._status = batch["status"]
        self._polled = time.monotonic()

    async def run(self) -> str | None:
        runner, batch = self.runner, self.batch
        done = await runner.store.done_lines(self.tenant_id, batch["id"])
        model = batch_model(self.lines)
        seen: set[str] = set()
        in_flight: set[asyncio.Task[None]] = set()
        ending: str | None = "completed"
        for index, raw in enumerate(self.lines):
            line = parse_line(index, raw, batch["endpoint"], model)
            if isinstance(line, BatchLine) and line.custom_id in seen:
                message = f"The custom_id {line.custom_id!r} is used by an earlier line."
                line = LineError(index, line.custom_id, "duplicate_custom_id", message)
            if line.custom_id is not None:
                seen.add(line.custom_id)
            self.custom_ids[index] = line.custom_id
            if index in done:
                continue
            ending = await self._ending()
            if ending != "completed":
                continue  # the rest only has its custom ids read (an expiry's error lines)
            if isinstance(line, LineError):
                entry = error_line(line.custom_id, line.code, line.message)
                await runner.store.record(self.tenant_id, batch["id"], index, False, entry)
                continue
            await runner._slots.acquire()
            ending = await self._ending()  # the wait for a slot may have seen the batch end
            if ending != "completed":
                runner._slots.release()
                continue
            task = asyncio.create_task(self._send(line))
            task.add_done_callback(lambda _: runner._slots.release())
            for tasks in (in_flight, runner._lines):
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        results = await asyncio.gather(*in_flight, return_exceptions=True)
        failures = [e for e in results if isinstance(e, BaseException)]
        if failures:  # Redis or a bug: the run ends here and resumes on the next scan
            raise failures[0]
        if runner.stopping:
            return None
        if len(await runner.store.done_lines(self.tenant_id, batch["id"])) == len(self.lines):
            return "completed"
        # lines without a result: those that stopped waiting saw the batch end otherwise
        ending = await self._ending()
        return None if ending == "completed" else ending

    async def _ending(self) -> str | None:
        """completed (go on), cancelled, expired, or None (stopping)."""
        if self.runner.stopping:
            return None
        if time.time() >= self.batch["expires_at"]:
            return "expired"
        if time.monotonic() - self._polled >= STATUS_POLL_S:
            self._polled = time.monotonic()
            state = await self.runner.store.load(self.tenant_id, self.batch["id"])
            self._status = state["status"]
        return "cancelled" if self._status == "cancelling" else "completed"

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` before a line tries again; False (stop waiting, leave the line
        unrecorded) once the batch is cancelled or expires or the gateway stops."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            if await self._ending() != "completed":
                return False
            await asyncio.sleep(min(left, STATUS_POLL_S))
        return await self._ending() == "completed"

    async def _send(self, line: BatchLine) -> None:
        """Send one line until it has an answer to record (or the gateway stops)."""
        runner, batch_id = self.runner, self.batch["id"]
        raw = json.dumps(line.body).encode()
        ctx = RequestContext(time.perf_counter(), f"{batch_id}-{line.index}")
        while True:
            try:
                if self.principal is None:  # the owner's key or tenant is gone
                    raise self.refused or AuthenticationError("The batch has no owner.")
                response = await runner.serve(
                    self.principal, raw, self.kind, self.batch["endpoint"], ctx
                )
            except BudgetExceededError as exc:  # the money budget is spent: no retry helps
                entry = output_line(line.custom_id, exc.status_code, ctx.request_id, exc.to_dict())
                await runner.store.record(self.tenant_id, batch_id, line.index, False, entry)
                return
            except LimitExceededError as exc:  # not run: wait for the limit, then again
                if await self._pause(_retry_after(exc)):
                    continue
                return
            except ServiceUnavailableError:  # no replica ready, or draining: not run either
                if await self._pause(RETRY_PAUSE_S):
                    continue
                return
            except APIError as exc:
                entry = output_line(line.custom_id, exc.status_code, ctx.request_id, exc.to_dict())
                await runner.store.record(self.tenant_id, batch_id, line.index, False, entry)
                return
            status, body = await _read(response)
            entry = output_line(line.custom_id, status, ctx.request_id, body)
            await runner.store.record(self.tenant_id, batch_id, line.index, status == 200, entry)
            return


def _retry_after(exc: LimitExceededError) -> float:
    try:
        return min(60.0, max(0.05, float(exc.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


async def _read(response: Response) -> tuple[int, Any]:
    """The status and JSON body of the request path's answer, its settling run (the
    background task a client's response would have run after sending)."""
    if isinstance(response, RelayResponse):  # not expected (lines are not streamed)
        exchange = response.exchange
        chunks = [exchange.first or b""]
        try:
            if exchange.rest is not None:
                chunks += [chunk async for chunk in exchange.rest]
        finally:
            if exchange.close is not None:
                await exchange.close()
            await response.on_close()
        data = b"".join(chunks)
    else:
        data = bytes(response.body)
        if response.background is not None:
            await response.background()
    try:
        body = json.loads(data)
    except ValueError:
        text = data.decode("utf-8", "replace")
        body = error_body(text, "upstream_error") if response.status_code >= 400 else text
    return response.status_code, body
