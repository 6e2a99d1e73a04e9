"""SIGTERM: a drain that lets in-flight streams finish (real engine), and a forced shutdown."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.gateway.dataplane.harness import (
    GatewayProcess,
    fake_engine_command,
    tiny_engine,
    wait_until,
)

NUM_STREAMS = 16
MAX_TOKENS = 400


@pytest.mark.slow
def test_sigterm_lets_16_streams_finish_refuses_new_requests_and_exits_0(
    tmp_path: Path, redis_server, tiny_llama_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    gw = GatewayProcess(
        tmp_path,
        {
            "redis": {"url": redis_server.url},
            "engines": [tiny_engine(tiny_llama_dir, "tiny", replicas=1)],
            "drain_timeout_s": 120,
        },
        {},
    )
    gw.start(timeout=600)
    try:
        _, key = gw.create_tenant("standard", overrides={"max_concurrency": 64})
        headers = {"authorization": f"Bearer {key}"}
        body = {
            "model": "tiny",
            "prompt": "Count slowly",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        started = threading.Semaphore(0)
        outcomes: list[object] = []

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", gw.base_url + "/v1/completions", json=body, headers=headers, timeout=300
                ) as resp:
                    events = []
                    for line in resp.iter_lines():
                        if line.startswith("data:"):
                            events.append(line)
                            if len(events) == 1:
                                started.release()
                    finish = json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"]
                    errors = sum('"error"' in e for e in events)
                    outcomes.append((resp.status_code, finish, errors, events[-1]))
            except Exception as exc:  # recorded and asserted below
                outcomes.append(exc)
                started.release()

        threads = [threading.Thread(target=stream) for _ in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        for _ in range(NUM_STREAMS):  # every stream is in flight
            assert started.acquire(timeout=300), gw.log()
        assert not outcomes, outcomes  # none has finished (or failed) yet
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)

        refused = _wait_for_refusal(gw, headers)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(300)
        assert gw.proc.wait(300) == 0, gw.log()
        assert outcomes == [(200, "length", 0, "data: [DONE]")] * NUM_STREAMS, outcomes
        log = gw.log()
        assert "drained: no request in flight" in log
    finally:
        gw.terminate()


def _wait_for_refusal(gw: GatewayProcess, headers: dict[str, str]) -> httpx.Response:
    """A new request while draining: 503 once the signal has been handled."""
    for _ in range(200):
        ready = httpx.get(gw.base_url + "/ready", timeout=10)
        if ready.status_code == 503:
            break
    return httpx.post(
        gw.base_url + "/v1/completions",
        headers=headers,
        timeout=10,
        json={"model": "tiny", "prompt": "new", "max_tokens": 2},
    )


def test_a_second_sigterm_forces_the_shutdown(tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    gw = GatewayProcess(
        tmp_path,
        {
            "redis": {"url": redis_server.url},
            "engines": [{"name": "fake", "command": fake_engine_command()}],
            "drain_timeout_s": 600,
        },
        {},
    )
    gw.start(timeout=120)
    try:
        _, key = gw.create_tenant("standard")
        engine_pid = gw.health()["engines"][0]["pid"]
        body = {
            "model": "fake",
            "prompt": "x",
            "max_tokens": 4000,
            "stream": True,
            "fake_chunk_delay_ms": 50,
        }
        with httpx.stream(
            "POST",
            gw.base_url + "/v1/completions",
            json=body,
            timeout=60,
            headers={"authorization": f"Bearer {key}"},
        ) as resp:
            lines = resp.iter_lines()
            next(lines)
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: _ready_status(gw) == 503, timeout=30)
            assert gw.proc.poll() is None  # still draining: the stream has minutes to go
            gw.proc.send_signal(signal.SIGTERM)
            assert gw.proc.wait(60) == 1
        assert wait_until(lambda: not _alive(engine_pid), timeout=30)
    finally:
        gw.terminate()


def _ready_status(gw: GatewayProcess) -> int:
    try:
        return httpx.get(gw.base_url + "/ready", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie has exited
