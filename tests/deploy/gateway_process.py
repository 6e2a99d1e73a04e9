"""A real ``portico serve`` process for the edge tests, supervising the gated engine.

The gateway runs from the real CLI with a config written here: one local model, ``gated``,
whose engine command is tests/deploy/gated_engine.py (started, health-checked and stopped by
the gateway's own supervisor), routing and retry policies of its own, and the test session's
Redis. Its admin key and key-hash secret come from the environment, as in compose.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from edge_nginx import REPO_ROOT, free_port

GATED_ENGINE = Path(__file__).resolve().parent / "gated_engine.py"
MODEL = "gated"

ROUTING = {
    "aliases": {},
    "tiers": [{"name": "only", "model": MODEL}],
    "weights": {},
    "keywords": [],
    "prefix_chars": 256,
}


class GatewayProcess:
    """``portico serve`` on a loopback port; ``start`` returns once ``/ready`` says 200."""

    def __init__(self, workdir: Path, redis_url: str, *, redis_url_in_env: bool = False) -> None:
        self.workdir = workdir
        self.redis_url_in_env = redis_url_in_env  # as compose passes it: PORTICO_REDIS_URL
        self.gate_dir = workdir / "gates"
        self.port = free_port()
        self.admin_key = "sk-admin-" + secrets.token_urlsafe(24)
        self.redis_url = redis_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "gateway.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def write_config(self) -> Path:
        policies = self.workdir / "policies"
        policies.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / "policies" / "retry.yaml", policies / "retry.yaml")
        (policies / "routing.yaml").write_text(yaml.safe_dump(ROUTING))
        self.gate_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "redis": {"data_dir": str(self.workdir / "data")},
            "policies_dir": str(policies),
            "runtime_dir": str(self.workdir / "run"),
            "engines": [
                {
                    "name": MODEL,
                    "model": MODEL,
                    "command": [
                        sys.executable,
                        str(GATED_ENGINE),
                        "--uds",
                        "{uds}",
                        "--gate-dir",
                        str(self.gate_dir),
                        "--served-model-name",
                        "{name}",
                    ],
                    "count_tokens_with": "estimate",
                    "startup_timeout_s": 120,
                }
            ],
            "drain_timeout_s": 5,
        }
        if not self.redis_url_in_env:
            config["redis"]["url"] = self.redis_url  # type: ignore[index]
        path = self.workdir / "portico.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> None:
        config = self.write_config()
        env = dict(
            os.environ,
            PORTICO_ADMIN_KEY=self.admin_key,
            PORTICO_KEY_HASH_SECRET=secrets.token_hex(32),
        )
        env.pop("PORTICO_REDIS_URL", None)
        if self.redis_url_in_env:
            env["PORTICO_REDIS_URL"] = self.redis_url
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "portico.cli", "serve", "--config", str(config)],
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the gateway did not become ready:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then stops its engine
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def create_key(self, tenant_id: str, plan: str = "standard") -> str:
        """A new tenant on ``plan`` and an API key for it, made through the admin API."""
        admin = {"authorization": f"Bearer {self.admin_key}"}
        r = httpx.post(
            self.url + "/admin/v1/tenants",
            headers=admin,
            json={"id": tenant_id, "name": tenant_id, "plan": plan},
        )
        r.raise_for_status()
        r = httpx.post(self.url + f"/admin/v1/tenants/{tenant_id}/keys", headers=admin, json={})
        r.raise_for_status()
        return str(r.json()["key"])

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text
