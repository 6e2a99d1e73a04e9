"""Fixtures of the engine server tests: a real `portico engine` process shared by the modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_server_process import EngineProcess


@pytest.fixture(scope="session")
def engine_server(
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcess]:
    """A real engine on a loopback port with an API key, started once for the session (each
    start costs seconds of CPU). Tests read its counters as deltas and leave it idle (nothing
    running, no KV held), which the modules using it check; an idle engine takes no CPU."""
    logs = tmp_path_factory.mktemp("engine-logs")
    server = EngineProcess(tiny_llama_dir, logs / "engine.log")
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.logs()


@pytest.fixture(scope="module")
def llava_server(
    tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """A real engine serving the tiny random LLaVA, up to 2 images a prompt, for one module."""
    logs = tmp_path_factory.mktemp("llava-logs")
    server = EngineProcess(
        tiny_llava_dir, logs / "engine.log", extra=["--limit-mm-per-prompt", "image=2"]
    )
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.logs()
