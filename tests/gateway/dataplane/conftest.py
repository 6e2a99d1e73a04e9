"""Fixtures for the data-plane tests (the harness itself is in ``harness.py``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.dataplane.harness import REPO_ROOT, answers, free_port, wait_until


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def fake_remote(module_tmp: Path) -> Iterator[str]:
    """A fake OpenAI-compatible server on TCP, standing in for a remote provider."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "load.fake_upstream", "--port", str(port), "--model", "remote"],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: answers(url + "/health"), timeout=30), "fake remote did not start"
    yield url
    proc.terminate()
    proc.wait(10)
