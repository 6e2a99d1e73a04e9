"""Harness for the data-plane tests: a real ``portico serve`` process and real upstreams.

``GatewayProcess`` writes a config and a policies folder, starts ``python -m portico.cli serve``
(which starts and supervises its engines), waits for ``/ready`` and creates tenants through the
real admin API. Nothing is mocked: engines are real ``portico engine`` processes (tiny model)
or the fast fake OpenAI-compatible server from ``load/fake_upstream.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
ADMIN_KEY = "test-admin-key-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_engine_command(*extra: str) -> list[str]:
    """A supervised fake engine: the fake upstream on the replica's Unix socket."""
    return [
        sys.executable,
        "-m",
        "load.fake_upstream",
        "--uds",
        "{uds}",
        "--model",
        "{name}",
        *extra,
    ]


def tiny_engine(tiny_dir: Path, name: str = "tiny", replicas: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "model": str(tiny_dir),
        "replicas": replicas,
        # float32: tests compare the engines' outputs with transformers' (auto may be bf16)
        "args": [
            "--kv-cache-memory",
            "32MiB",
            "--max-num-seqs",
            "32",
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
        ],  # fmt: skip
    }


class GatewayProcess:
    """One ``portico serve`` subprocess with its own config, policies and log file."""

    def __init__(
        self,
        workdir: Path,
        config: dict[str, Any],
        routing: dict[str, Any],
        retry: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        policies = workdir / "policies"
        policies.mkdir(parents=True, exist_ok=True)
        (policies / "routing.yaml").write_text(yaml.safe_dump(routing))
        (policies / "retry.yaml").write_text(yaml.safe_dump(retry or {}))
        self.config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "policies_dir": str(policies),
            "runtime_dir": str(workdir / "run"),
            "log_level": "info",
            **config,
        }
        self.config.setdefault("redis", {})
        self.config["redis"].setdefault("data_dir", str(workdir / "data"))
        self.config_path = workdir / "portico.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = workdir / "gateway.log"
        self.proc: subprocess.Popen[bytes] | None = None
        scheme = "https" if "tls" in config else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0, verify: Any = True) -> None:
        env = {**os.environ, "PORTICO_ADMIN_KEY": ADMIN_KEY, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "portico.cli", "serve", "-c", str(self.config_path)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"gateway not ready in {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self, verify: Any = True) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=5, verify=verify).json()

    def create_tenant(
        self, plan: str = "standard", verify: Any = True, cert: Any = None, **fields: Any
    ) -> tuple[str, str]:
        """A new tenant and one API key for it: (tenant_id, secret)."""
        tenant_id = "t" + uuid.uuid4().hex[:10]
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(
            base_url=self.base_url, headers=headers, verify=verify, cert=cert, timeout=10
        ) as client:
            r = client.post(
                "/admin/v1/tenants",
                json={"id": tenant_id, "name": tenant_id, "plan": plan, **fields},
            )
            r.raise_for_status()
            r = client.post(f"/admin/v1/tenants/{tenant_id}/keys", json={})
            r.raise_for_status()
            return tenant_id, r.json()["key"]

    def terminate(self, timeout: float = 120.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def live_slots(redis_url: str, tenant_id: str) -> int:
    """Concurrency slots the tenant holds now (admission's ZSETs in Redis)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"portico:rl:{{{tenant_id}}}:*conc*"))
        return sum(int(client.zcard(k)) for k in keys)
    finally:
        client.close()


def wait_until(predicate: Any, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def usage_requests(redis_url: str, tenant: str) -> int:
    """Requests in the tenant's usage records (all days, keys and models)."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"portico:usage:{{{tenant}}}:*"))
        return sum(int(client.hget(k, "requests") or 0) for k in keys)
    finally:
        client.close()


async def read_request(reader: asyncio.StreamReader) -> None:
    """Read one HTTP/1.1 request (its head, then a Content-Length body) off ``reader``: what a
    fake upstream on a raw socket does before it answers."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)
