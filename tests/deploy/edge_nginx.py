"""Render nginx/portico.conf.template into a private directory and run a real nginx on it.

The template's placeholders are envsubst-style ``${PORTICO_*}``; rendering here is the same
substitution the nginx image's entrypoint does in compose, but strict: a placeholder without a
value is an error, never an empty string. nginx runs as a non-daemon child with ``-p`` pointing
at the private directory, so its pid file, temp files and logs never touch the system's nginx.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import trustme

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "nginx" / "portico.conf.template"
PLACEHOLDER = re.compile(r"\$\{(PORTICO_[A-Z0-9_]+)\}")


@dataclass(frozen=True)
class EdgePKI:
    """A test CA and a server certificate for ``localhost`` / 127.0.0.1 signed by it."""

    ca: trustme.CA
    cert: Path  # leaf + chain, PEM
    key: Path
    ca_cert: Path


@contextlib.contextmanager
def private_edge_dir() -> Iterator[Path]:
    """A private nginx prefix directory that nginx's workers can enter.

    Run as root, nginx's workers drop to ``nobody``; pytest's own temp folders are 0700, so
    the workers could not reach their temp files there. This folder is 0755 (its files are
    a throwaway test CA's), and is removed afterwards.
    """
    path = Path(tempfile.mkdtemp(prefix="portico-edge-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise FileNotFoundError("nginx is not installed (apt-get install nginx)")
    return found


def placeholders(text: str) -> set[str]:
    """Every ``${PORTICO_*}`` name in ``text``."""
    return set(PLACEHOLDER.findall(text))


def render(text: str, values: Mapping[str, str]) -> str:
    """Substitute every placeholder; KeyError names the first one without a value."""
    missing = sorted(placeholders(text) - set(values))
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` different free ports: the sockets stay bound until all are chosen, so the
    kernel cannot hand the same port out twice (two equal ports made nginx refuse its config
    as "a duplicate default server")."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def default_values(prefix: Path, cert: Path, key: Path, gateway_addr: str) -> dict[str, str]:
    """Values for a test: loopback ports, the test CA's certificate, generous limits."""
    http_port, https_port = free_ports(2)
    return {
        "PORTICO_SERVER_NAME": "localhost",
        "PORTICO_HTTP_PORT": f"127.0.0.1:{http_port}",
        "PORTICO_HTTPS_PORT": f"127.0.0.1:{https_port}",
        "PORTICO_PUBLIC_HTTPS_PORT": str(https_port),
        "PORTICO_TLS_CERT": str(cert),
        "PORTICO_TLS_KEY": str(key),
        "PORTICO_GATEWAY_ADDR": gateway_addr,
        "PORTICO_RATE_LIMIT": "100r/s",
        "PORTICO_RATE_BURST": "200",
        "PORTICO_ADMIN_RATE_LIMIT": "100r/s",
        "PORTICO_ADMIN_RATE_BURST": "200",
        "PORTICO_CONN_LIMIT": "100",
        "PORTICO_CLIENT_MAX_BODY_SIZE": "4m",
        "PORTICO_PROXY_READ_TIMEOUT": "3600s",
        "PORTICO_NGINX_ACCESS_LOG": str(prefix / "access.log"),
    }


class EdgeNginx:
    """One nginx master (+ workers) on a rendered copy of the template, owned by a test.

    ``start`` returns once both listeners accept connections; ``stop`` ends the master (which
    ends its workers) and waits for it. The directory holds the config, pid, temp files and the
    error log, which ``error_log`` returns for assertion messages.
    """

    def __init__(self, prefix: Path, values: Mapping[str, str]) -> None:
        self.prefix = prefix
        self.values = dict(values)
        self.conf = prefix / "portico.conf"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def https_port(self) -> int:
        return int(self.values["PORTICO_HTTPS_PORT"].rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        return int(self.values["PORTICO_HTTP_PORT"].rsplit(":", 1)[1])

    def write(self) -> Path:
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(render(TEMPLATE.read_text(), self.values))
        return self.conf

    def check(self) -> subprocess.CompletedProcess[str]:
        """``nginx -t`` on the rendered config."""
        self.write()
        return subprocess.run(
            [nginx_binary(), "-t", "-p", f"{self.prefix}/", "-c", str(self.conf)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        self.write()
        with open(self.prefix / "error.log", "ab") as err:
            self.proc = subprocess.Popen(
                [
                    nginx_binary(),
                    "-p",
                    f"{self.prefix}/",
                    "-c",
                    str(self.conf),
                    "-g",
                    "daemon off;",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited {self.proc.returncode}:\n{self.error_log()}")
            if _accepts(self.https_port) and _accepts(self.http_port):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not start listening:\n{self.error_log()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown of master and workers
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
