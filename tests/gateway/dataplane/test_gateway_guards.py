"""A gateway process with a small admin limit: failed admin-key guesses are counted (429 before
the key is checked), ``/metrics/engines`` answers, and usage still pending in the batch is
written when the gateway shuts down."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, fake_engine_command

ADMIN_LIMIT = 8  # 6 used by create_tenant in this module


@pytest.fixture(scope="module")
def redis_for_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this module's own: the admin guesses below must not count elsewhere."""
    from tests.conftest import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("guards-redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_for_module: str) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_for_module},
            "admission": {"abuse": {"admin": f"{ADMIN_LIMIT}/minute"}},
            "max_body_bytes": 16 * 1024,
            "engines": [{"name": "fake", "replicas": 1, "command": fake_engine_command()}],
        },
        {},
        {},
    )
    gw.start(timeout=120)
    yield gw
    gw.terminate()


def test_hot_routes_keep_the_body_limit_for_chunked_bodies_and_405_for_other_methods(
    gateway: GatewayProcess,
) -> None:
    _, key = gateway.create_tenant("standard")

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        yield b'{"model": "fake", "prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(
        gateway.base_url + "/v1/completions",
        content=chunks(),
        timeout=30,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert r.headers["x-request-id"]
    r = httpx.get(gateway.base_url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_client_leaving_before_its_body_arrives_leaves_no_error_and_no_slot(
    gateway: GatewayProcess, redis_for_module: str
) -> None:
    import socket
    from urllib.parse import urlparse

    from tests.gateway.dataplane.harness import live_slots

    tenant_id, key = gateway.create_tenant("standard")
    where = urlparse(gateway.base_url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: 5000\r\n\r\n"
            b'{"model": "fake", "prompt": "only part of the body'
        )
    # the gateway is still healthy, took no concurrency slot, and logged no traceback
    r = httpx.post(
        gateway.base_url + "/v1/completions",
        timeout=30,
        headers={"authorization": f"Bearer {key}"},
        json={"model": "fake", "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    assert live_slots(redis_for_module, tenant_id) == 0
    assert "ClientDisconnect" not in gateway.log()
    assert "Traceback" not in gateway.log()


def test_usage_pending_at_shutdown_is_written_and_admin_guesses_are_limited(
    gateway: GatewayProcess, redis_for_module: str
) -> None:
    """Runs last in this module: it uses up the admin limit and shuts the gateway down."""
    tenant_id, key = gateway.create_tenant("standard")  # two more admin requests
    r = httpx.post(
        gateway.base_url + "/v1/completions",
        timeout=30,
        headers={"authorization": f"Bearer {key}"},
        json={"model": "fake", "prompt": "hi", "max_tokens": 4},
    )
    assert r.status_code == 200, r.text

    statuses = []
    for i in range(ADMIN_LIMIT + 2):
        resp = httpx.get(
            gateway.base_url + "/admin/v1/tenants",
            timeout=10,
            headers={"authorization": f"Bearer wrong-admin-key-{i}"},
        )
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            assert resp.json()["error"]["type"] == "rate_limit_error"
    assert 429 in statuses, statuses
    first_429 = statuses.index(429)
    assert statuses[0] == 401 and set(statuses[:first_429]) == {401}, statuses
    assert set(statuses[first_429:]) == {429}, statuses
    # the limit counts before the key is checked: the right key is refused too now
    right = httpx.get(
        gateway.base_url + "/admin/v1/tenants",
        timeout=10,
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert right.status_code == 429

    engines = httpx.get(gateway.base_url + "/metrics/engines", timeout=10)
    assert engines.status_code == 200
    list(text_string_to_metric_families(engines.text))  # well-formed (fake engines: no metrics)

    assert gateway.terminate() == 0, gateway.log()
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    client = redis.Redis.from_url(redis_for_module)
    try:
        row = client.hgetall(f"portico:usage:{{{tenant_id}}}:{day}")
    finally:
        client.close()
    assert int(row[b"requests"]) == 1 and int(row[b"fake|requests"]) == 1, row
