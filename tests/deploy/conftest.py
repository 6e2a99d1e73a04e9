"""Fixtures of the deployment tests: private nginx directories, a test CA, external tools.

The tools (nginx, promtool, docker-compose) are real binaries from Debian's packages. Outside
CI a missing one skips its tests; in CI (``CI`` set) it fails them, because CI installs them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from edge_nginx import EdgePKI, private_edge_dir

IN_CI = bool(os.environ.get("CI"))


def require_tool(name: str, package: str) -> str:
    """Path of ``name`` on PATH; skip (outside CI) or fail (in CI) when it is missing."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed (apt-get install {package})"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "prometheus")


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return require_tool("docker-compose", "docker-compose")


@pytest.fixture
def edge_dir() -> Iterator[Path]:
    with private_edge_dir() as path:
        yield path


@pytest.fixture(scope="session")
def test_pki(tmp_path_factory: pytest.TempPathFactory) -> EdgePKI:
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    cert, key, ca_cert = folder / "fullchain.pem", folder / "privkey.pem", folder / "ca.pem"
    leaf.private_key_pem.write_to_path(str(key))
    for i, blob in enumerate(leaf.cert_chain_pems):
        blob.write_to_path(str(cert), append=i > 0)
    ca.cert_pem.write_to_path(str(ca_cert))
    return EdgePKI(ca=ca, cert=cert, key=key, ca_cert=ca_cert)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[Any]:
    """A real ``portico serve`` supervising the gated engine, on the session's Redis; one per
    test module, so it does not outlive the tests that use it."""
    from gateway_process import GatewayProcess

    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    process = GatewayProcess(tmp_path_factory.mktemp("gateway"), redis_server.url)
    process.start()
    try:
        yield process
    finally:
        process.stop()
