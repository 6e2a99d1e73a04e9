"""Per-address abuse limits (slowapi, real Redis): failed logins, anonymous requests, admin."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from gateway.admission.abuse import AbuseGuard, AbuseSettings, limits_storage_uri
from portico.errors import RateLimitError
from portico.http_errors import install_error_handlers


@pytest.fixture
def guard(redis_url: str) -> AbuseGuard:
    settings = AbuseSettings(unauthenticated="3/minute", failed_auth="2/minute", admin="2/minute")
    return AbuseGuard(redis_url, settings, registry=CollectorRegistry())


def test_storage_uri_follows_limits_schemes() -> None:
    assert limits_storage_uri("unix:///run/redis.sock") == "redis+unix:///run/redis.sock"
    assert limits_storage_uri("redis://h:6379/0") == "redis://h:6379/0"
    assert limits_storage_uri("rediss://h:6380") == "rediss://h:6380"
    with pytest.raises(ValueError, match="unsupported"):
        limits_storage_uri("memcached://h")


def test_settings_reject_an_unparsable_limit() -> None:
    with pytest.raises(ValidationError, match="admin"):
        AbuseSettings(admin="lots")


async def test_failed_authentications_lock_the_address_out(guard: AbuseGuard) -> None:
    await guard.check_failed_auth("10.0.0.1")
    await guard.record_failed_auth("10.0.0.1")
    await guard.check_failed_auth("10.0.0.1")
    await guard.record_failed_auth("10.0.0.1")
    with pytest.raises(RateLimitError) as info:
        await guard.check_failed_auth("10.0.0.1")  # even a right key is not looked at now
    err = info.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert 1 <= int(err.headers["retry-after"]) <= 60
    assert 0 < int(err.headers["retry-after-ms"]) <= 60_000
    assert "failed auth" in err.message
    await guard.check_failed_auth("10.0.0.2")  # other addresses are not affected


async def test_unauthenticated_requests_are_limited_per_address(guard: AbuseGuard) -> None:
    for _ in range(3):
        await guard.hit_unauthenticated("10.0.0.3")
    with pytest.raises(RateLimitError):
        await guard.hit_unauthenticated("10.0.0.3")
    await guard.hit_unauthenticated("10.0.0.4")


async def test_counts_are_shared_through_redis(redis_url: str) -> None:
    settings = AbuseSettings(failed_auth="2/minute")
    replica_a = AbuseGuard(redis_url, settings)
    replica_b = AbuseGuard(redis_url, settings)
    await replica_a.record_failed_auth("10.0.0.5")
    await replica_b.record_failed_auth("10.0.0.5")
    with pytest.raises(RateLimitError):
        await replica_a.check_failed_auth("10.0.0.5")


async def test_admin_router_is_limited_per_address(guard: AbuseGuard) -> None:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(prefix="/admin/v1")

    @router.get("/tenants")
    async def tenants() -> dict[str, list[str]]:
        return {"data": []}

    app.include_router(router, dependencies=[Depends(guard.admin_dependency)])
    transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 4711))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get("/admin/v1/tenants")).status_code == 200
        assert (await client.get("/admin/v1/tenants")).status_code == 200
        refused = await client.get("/admin/v1/tenants")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1


async def test_an_unreachable_redis_lets_requests_through_and_logs_once(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="portico.abuse")
    guard = AbuseGuard(f"unix://{tmp_path}/absent.sock", AbuseSettings(unauthenticated="1/minute"))
    for _ in range(5):
        await guard.hit_unauthenticated("10.0.0.6")
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
