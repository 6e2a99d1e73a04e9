"""Supervisor: start, readiness, restart with backoff after a crash, tagged logs, stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from gateway.fleet.pool import Replica
from gateway.fleet.supervisor import EngineProcess, Supervisor


def fake_process(tmp_path: Path, name: str) -> EngineProcess:
    uds = tmp_path / f"{name}.sock"
    client = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(uds)), base_url="http://engine"
    )
    argv = [sys.executable, "-m", "load.fake_upstream", "--uds", str(uds), "--model", name]
    return EngineProcess(name, argv, Replica(name, client), socket_path=uds, startup_timeout_s=60)


async def wait_for(predicate, timeout: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


async def test_crashed_engine_is_restarted_and_marked_down_meanwhile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="portico.engine")
    proc = fake_process(tmp_path, "e0")
    restarts: list[str] = []
    sup = Supervisor([proc], backoff_base_s=0.3, on_restart=lambda p: restarts.append(p.name))
    try:
        assert await sup.start(ready_timeout=60)
        assert proc.state == "ready" and proc.replica.up
        first_pid = proc.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        assert await wait_for(lambda: not proc.replica.up, 10)
        assert await wait_for(lambda: proc.state == "ready" and proc.pid != first_pid)
        assert proc.restarts == 1 and restarts == ["e0"] and proc.replica.up
        resp = await proc.replica.client.get("/health")
        assert resp.status_code == 200
        assert any(r.getMessage().startswith("[e0] ") for r in caplog.records)
    finally:
        await sup.stop(timeout_s=10)
        await proc.replica.client.aclose()
    assert proc.state == "stopped" and not proc.replica.up
    assert proc.proc is not None and proc.proc.returncode is not None


async def test_backoff_doubles_up_to_the_cap_while_an_engine_keeps_failing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="portico.gateway.supervisor")
    uds = tmp_path / "bad.sock"
    client = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(uds)), base_url="http://engine"
    )
    failing = EngineProcess(
        "bad",
        [sys.executable, "-c", "raise SystemExit(3)"],
        Replica("bad", client),
        socket_path=uds,
        startup_timeout_s=30,
    )
    sup = Supervisor([failing], backoff_base_s=0.05, backoff_max_s=0.2)
    try:
        assert not await sup.start(ready_timeout=0.01)
        assert await wait_for(lambda: failing.restarts >= 4)
        assert not failing.replica.up
    finally:
        await sup.stop(timeout_s=5)
        await client.aclose()
    delays = [
        r.getMessage().rsplit(" in ", 1)[1]
        for r in caplog.records
        if r.getMessage().startswith("engine bad exited; restart")
    ]
    assert delays[:4] == ["0.05 s", "0.10 s", "0.20 s", "0.20 s"]  # doubling, capped
