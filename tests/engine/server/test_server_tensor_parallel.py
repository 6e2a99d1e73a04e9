"""A real `portico engine --tensor-parallel-size 2` process: it serves, a dead worker makes
it exit non-zero at once (so the gateway's supervisor restarts it), SIGTERM drains it and
stops its worker, and a worker whose engine is gone exits. No process is left behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

from engine.distributed.leader import EXIT_WORKER_DIED

WAIT_S = 60.0  # generous bound for a busy 2-core machine; no assertion on time


@pytest.fixture
def tp_server(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[EngineProcess]:
    server = EngineProcess(
        tiny_llama_dir, tmp_path / "engine.log", extra=["--tensor-parallel-size", "2"]
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def workers_of(server: EngineProcess) -> list[psutil.Process]:
    workers = psutil.Process(server.proc.pid).children()
    assert len(workers) == 1, [w.cmdline() for w in workers]
    assert "engine.distributed.worker" in workers[0].cmdline()
    return workers


def complete(server: EngineProcess) -> dict:
    body = {"model": MODEL_NAME, "prompt": "Split", "max_tokens": 8, "temperature": 0}
    with server.client() as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow  # its own engine and worker processes (the test ends them: none to share)
def test_sigterm_drains_and_leaves_no_worker(tp_server: EngineProcess) -> None:
    worker = workers_of(tp_server)[0]
    assert complete(tp_server)["usage"]["completion_tokens"] == 8
    tp_server.proc.send_signal(signal.SIGTERM)
    assert tp_server.proc.wait(timeout=WAIT_S) == 0, tp_server.logs()
    gone, alive = psutil.wait_procs([worker], timeout=WAIT_S)
    assert not alive


@pytest.mark.slow  # its own engine and worker processes (the test ends them: none to share)
def test_a_killed_worker_makes_the_engine_exit_non_zero(tp_server: EngineProcess) -> None:
    worker = workers_of(tp_server)[0]
    worker.kill()
    assert tp_server.proc.wait(timeout=WAIT_S) == EXIT_WORKER_DIED, tp_server.logs()
    assert "tensor-parallel worker rank 1 exited" in tp_server.logs()


def test_a_worker_whose_engine_died_exits(tmp_path: Path) -> None:
    """The worker's own watch of its parent (what frees it when the engine is SIGKILLed):
    a real worker process, started by a parent that dies before the rendezvous completes."""
    parent = subprocess.Popen(
        [sys.executable, "-c", SPAWN_WORKER_THEN_HANG], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    worker = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    worker.wait(timeout=WAIT_S)
    assert not worker.is_running()


# A parent that starts a worker for a rendezvous nobody serves, prints its pid and waits.
SPAWN_WORKER_THEN_HANG = """
import json, os, subprocess, sys, time
config = json.dumps({"model": "unused"})
argv = [sys.executable, "-m", "engine.distributed.worker", "--rank", "1", "--world-size", "2",
        "--port", "9", "--config", config, "--parent-pid", str(os.getpid())]
print(subprocess.Popen(argv).pid, flush=True)
time.sleep(600)
"""
