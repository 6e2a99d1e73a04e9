"""Starts, watches, restarts and drains the engine processes the gateway serves from.

Each replica is one child process (``portico engine ... --uds PATH`` by default) listening on a
Unix socket in the runtime directory. A watcher task per replica owns its whole life: spawn,
wait for ``/health`` then ``/ready``, mark the replica up in its pool, wait for the process to
exit, mark it down, and — unless the gateway is stopping — restart it after an exponential
backoff (reset once a process has stayed up for ``stable_after_s``). Engine stdout/stderr lines
go to the gateway's log tagged with the replica's name, read asynchronously.

``stop`` sends SIGTERM to every engine (they drain their own requests), waits up to a timeout,
then SIGKILLs what is left. A child also gets SIGTERM if the gateway dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.fleet.pool import Replica

log = logging.getLogger("portico.gateway.supervisor")
engine_log = logging.getLogger("portico.engine")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def engine_argv(model: str, served_model_name: str, uds: Path, extra: list[str]) -> list[str]:
    """The default command line of one engine replica."""
    return [
        sys.executable,
        "-m",
        "portico.cli",
        "engine",
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--uds",
        str(uds),
        *extra,
    ]


@dataclass(eq=False)
class EngineProcess:
    """One supervised replica: how to start it, the pool entry it drives, its state."""

    name: str
    argv: list[str]
    replica: Replica
    socket_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0
    state: str = "stopped"  # stopped | starting | ready | crashed | stopping
    restarts: int = 0
    pid: int | None = None
    proc: asyncio.subprocess.Process | None = field(default=None, repr=False)


class Supervisor:
    """Owns the engine processes; ``start`` returns once every replica was started once and
    became ready (or ``ready_timeout`` passed — the watchers keep trying in the background)."""

    def __init__(
        self,
        processes: list[EngineProcess],
        *,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        stable_after_s: float = 30.0,
        on_state: Callable[[EngineProcess], None] | None = None,
        on_restart: Callable[[EngineProcess], None] | None = None,
    ) -> None:
        self.processes = processes
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.stable_after_s = stable_after_s
        self.on_state = on_state
        self.on_restart = on_restart
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._ready_events = {p.name: asyncio.Event() for p in processes}

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "name": p.name,
                "state": p.state,
                "pid": p.pid,
                "restarts": p.restarts,
                "up": p.replica.available,
                "outstanding": p.replica.outstanding,
            }
            for p in self.processes
        ]

    @property
    def all_ready(self) -> bool:
        return all(p.state == "ready" for p in self.processes)

    async def start(self, ready_timeout: float | None = None) -> bool:
        """Spawn every watcher; wait until all replicas are ready. True if they all are."""
        for proc in self.processes:
            self._tasks.append(asyncio.create_task(self._watch(proc), name=f"watch-{proc.name}"))
        waits = [e.wait() for e in self._ready_events.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), ready_timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _set_state(self, proc: EngineProcess, state: str) -> None:
        proc.state = state
        if self.on_state is not None:
            self.on_state(proc)

    async def _watch(self, proc: EngineProcess) -> None:
        failures = 0
        while not self._stopping:
            started = time.monotonic()
            became_ready = await self._run_once(proc)
            if self._stopping:
                break
            if became_ready and time.monotonic() - started > self.stable_after_s:
                failures = 0
            failures += 1
            proc.restarts += 1
            self._set_state(proc, "crashed")
            if self.on_restart is not None:
                self.on_restart(proc)
            delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (failures - 1))
            log.warning("engine %s exited; restart %d in %.2f s", proc.name, proc.restarts, delay)
            await asyncio.sleep(delay)

    async def _run_once(self, proc: EngineProcess) -> bool:
        """Run the process until it exits; True if it became ready on the way."""
        if proc.socket_path is not None:
            proc.socket_path.unlink(missing_ok=True)
        self._set_state(proc, "starting")
        child = await asyncio.create_subprocess_exec(
            *proc.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **proc.env},
            preexec_fn=_die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C reaches the gateway, which drains them
            limit=1 << 20,
        )
        proc.proc, proc.pid = child, child.pid
        log.info("engine %s started (pid %d)", proc.name, child.pid)
        pump = asyncio.create_task(self._pump_output(proc.name, child))
        exited = asyncio.create_task(child.wait())
        ready = asyncio.create_task(self._wait_ready(proc))
        became_ready = False
        try:
            done, _ = await asyncio.wait({exited, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready in done and ready.result() and not exited.done():
                became_ready = True
                proc.replica.ejected = False
                proc.replica.consecutive_failures = 0
                proc.replica.up = True
                self._set_state(proc, "ready")
                self._ready_events[proc.name].set()
                log.info("engine %s ready", proc.name)
            elif not exited.done():
                log.error(
                    "engine %s not ready after %.0f s; killing it",
                    proc.name,
                    proc.startup_timeout_s,
                )
                child.kill()
            await exited
        finally:
            ready.cancel()
            proc.replica.up = False
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(pump, 2.0)
            pump.cancel()
        log.info("engine %s exited with %s", proc.name, child.returncode)
        return became_ready

    async def _wait_ready(self, proc: EngineProcess) -> bool:
        deadline = time.monotonic() + proc.startup_timeout_s
        client = proc.replica.client
        path = "/health"
        while time.monotonic() < deadline:
            try:
                resp = await client.get(path, timeout=2.0)
                if resp.status_code == 200:
                    if path == "/ready":
                        return True
                    path = "/ready"
                    continue
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        return False

    async def _pump_output(self, name: str, child: asyncio.subprocess.Process) -> None:
        stream = child.stdout
        if stream is None:
            return
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the limit: skip what is buffered
                continue
            if not line:
                return
            engine_log.info("[%s] %s", name, line.decode(errors="replace").rstrip())

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every engine, wait up to ``timeout_s`` for them to drain, SIGKILL the rest."""
        self._stopping = True
        running = [p for p in self.processes if p.proc is not None and p.proc.returncode is None]
        for p in running:
            self._set_state(p, "stopping")
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        waits = [p.proc.wait() for p in running]  # type: ignore[union-attr]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except asyncio.TimeoutError:
            for p in running:
                if p.proc is not None and p.proc.returncode is None:
                    log.error("engine %s did not drain in %.0f s; killing it", p.name, timeout_s)
                    with contextlib.suppress(ProcessLookupError):
                        p.proc.kill()
            await asyncio.gather(*waits, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self.processes:
            self._set_state(p, "stopped")
            p.replica.up = False
            if p.socket_path is not None:
                p.socket_path.unlink(missing_ok=True)
