"""A real `portico engine` process serving the tiny Llama, and clients to talk to it.

Nothing is faked: the process is started exactly as a user (or the gateway) starts it, with
``python -m portico.cli engine ...``, and is talked to over TCP or a Unix socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny"
API_KEY = "sk-test-engine-key"
MAX_MODEL_LEN = 256
STARTUP_TIMEOUT_S = 240.0  # model load on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineProcess:
    """One `portico engine` subprocess and clients to talk to it."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        *,
        uds: str | None = None,
        api_key: str | None = API_KEY,
        extra: list[str] | None = None,
        dtype: str = "float32",
    ) -> None:
        self.uds = uds
        self.port = None if uds else free_port()
        self.api_key = api_key
        self.log_path = log_path
        args = [
            sys.executable,
            "-m",
            "portico.cli",
            "engine",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--kv-cache-memory",
            "8MiB",
            "--max-num-seqs",
            "16",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--log-level",
            "warning",
            # float32 by default: tests compare outputs with transformers' (--dtype auto is
            # bf16 on CPUs with native bf16); the README test runs "auto", what `make run` does
            "--dtype",
            dtype,
        ]
        args += ["--uds", uds] if uds else ["--port", str(self.port)]
        if api_key:
            args += ["--api-key", api_key]
        args += extra or []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PORTICO_ENGINE_API_KEY", None)
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def base_url(self) -> str:
        return "http://engine" if self.uds else f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(
            base_url=self.base_url, transport=transport, headers=headers, timeout=120, **kwargs
        )  # type: ignore[arg-type]

    def async_client(self) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(
            base_url=self.base_url, transport=transport, headers=headers, timeout=120
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self.client() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.logs()}")
                try:
                    if client.get("/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"engine not ready in time:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        with self.client() as client:
            text = client.get("/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def metric(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(dict(labels, model_name=MODEL_NAME).items())))
    return samples.get(key, 0.0)
