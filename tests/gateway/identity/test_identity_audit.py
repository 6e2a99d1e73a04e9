"""The audit log: one entry per admin change, with who, what, before/after, when and from
where, never a secret; readable through ``GET /admin/v1/audit`` (filters, paging); written as
a JSON log line too; trimmed by its retention settings. Real Redis (both backends)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from identity_app import ADMIN_KEY, admin_headers, assert_openai_error, bearer
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.identity.audit import STREAM_KEY, Actor, AuditLog, AuditSettings
from gateway.identity.auth import Identity

A = admin_headers()


async def audit(client: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    resp = await client.get("/admin/v1/audit", headers=A, params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def raw_stream(identity: Identity) -> str:
    """Everything the stream holds, as one string (to search for secrets)."""
    entries = await identity.store.redis.xrange(STREAM_KEY)
    return repr(entries)


async def test_every_admin_change_is_recorded_without_secrets(
    client: httpx.AsyncClient, identity: Identity, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="portico.audit")
    resp = await client.post("/admin/v1/tenants", headers=A, json={"id": "acme", "name": "Acme"})
    assert resp.status_code == 201
    resp = await client.patch(
        "/admin/v1/tenants/acme",
        headers=A,
        json={"plan": "standard", "overrides": {"requests_per_minute": 7}},
    )
    assert resp.status_code == 200
    created = (await client.post("/admin/v1/tenants/acme/keys", headers=A, json={})).json()
    rotated = (
        await client.post(
            f"/admin/v1/tenants/acme/keys/{created['id']}/rotate",
            headers=A,
            json={"grace_seconds": 60},
        )
    ).json()
    resp = await client.post(f"/admin/v1/tenants/acme/keys/{rotated['id']}/revoke", headers=A)
    assert resp.status_code == 200
    assert (await client.delete("/admin/v1/tenants/acme", headers=A)).status_code == 204
    # Reads and refused changes are not changes.
    await client.get("/admin/v1/tenants", headers=A)
    assert_openai_error(await client.delete("/admin/v1/tenants/nope", headers=A), 404)

    entries = (await audit(client))["data"]
    assert [e["action"] for e in entries] == [
        "tenant.delete",
        "key.revoke",
        "key.rotate",
        "key.create",
        "tenant.update",
        "tenant.create",
    ]
    admin_id = identity.authenticator.admin_key_id
    assert admin_id is not None and admin_id.startswith("admin-")
    for e in entries:
        assert e["actor"] == admin_id and e["actor_kind"] == "admin_key"
        assert e["address"] == "127.0.0.1" and e["tenant_id"] == "acme"
        assert abs(e["time"] - time.time()) < 600
    delete, revoke, rotate, create_key, update, create = entries
    assert create["target"] == "tenant:acme"
    assert create["before"] is None and create["after"]["plan"] == "free"
    assert update["before"]["plan"] == "free" and update["after"]["plan"] == "standard"
    assert update["before"]["overrides"]["requests_per_minute"] is None
    assert update["after"]["overrides"]["requests_per_minute"] == 7
    assert create_key["target"] == created["id"] and create_key["after"]["status"] == "active"
    assert rotate["after"]["new_key"]["id"] == rotated["id"]
    assert rotate["after"]["old_key"]["replaced_by"] == rotated["id"]
    assert rotate["after"]["grace_seconds"] == 60
    assert revoke["before"]["status"] == "active" and revoke["after"]["status"] == "revoked"
    assert delete["before"]["id"] == "acme" and delete["after"] is None

    # No secret anywhere: not the key secrets, their digests, the tenant uid or the admin key.
    digests = [identity.store.digest(s) for s in (created["key"], rotated["key"])]
    stored = await raw_stream(identity)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "portico.audit")
    for text in (stored, logged, json.dumps(entries)):
        for secret in (created["key"], rotated["key"], ADMIN_KEY, *digests):
            assert secret not in text
        assert "digest" not in text and '"uid"' not in text and "'uid'" not in text

    # One structured (JSON) log line per change, same content as the stream.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "portico.audit"]
    assert [line["action"] for line in lines] == [e["action"] for e in reversed(entries)]
    assert lines[0]["event"] == "admin_change" and lines[0]["actor"] == admin_id


async def test_audit_filters_and_pages(client: httpx.AsyncClient, make_tenant) -> None:
    for i in range(5):
        await make_tenant(f"t{i}")
    await client.patch("/admin/v1/tenants/t1", headers=A, json={"disabled": True})
    await client.post("/admin/v1/tenants/t2/keys", headers=A, json={})

    page1 = await audit(client, limit=3)
    assert len(page1["data"]) == 3 and page1["next"] == page1["data"][-1]["id"]
    page2 = await audit(client, limit=3, before=page1["next"])
    page3 = await audit(client, limit=3, before=page2["next"])
    ids = [e["id"] for e in page1["data"] + page2["data"] + page3["data"]]
    assert len(ids) == 7 == len(set(ids)) and page3["next"] is None

    assert [e["tenant_id"] for e in (await audit(client, tenant_id="t1"))["data"]] == ["t1"] * 2
    creates = (await audit(client, action="tenant.create"))["data"]
    assert [e["target"] for e in creates] == [f"tenant:t{i}" for i in (4, 3, 2, 1, 0)]
    tenant_changes = (await audit(client, action="tenant."))["data"]
    assert len(tenant_changes) == 6
    assert [e["action"] for e in (await audit(client, action="key."))["data"]] == ["key.create"]
    assert (await audit(client, actor="someone-else"))["data"] == []
    assert (await audit(client, since=time.time() + 3600))["data"] == []
    assert len((await audit(client, until=time.time() + 3600))["data"]) == 7
    # The least stream id as a cursor: nothing is older (Redis refuses the range "(0-0").
    first = await audit(client, before="000000-0")
    assert (first["data"], first["next"]) == ([], None)


async def test_audit_needs_the_admin_credential_and_valid_params(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme")
    secret = (await make_key("acme"))["key"]
    assert_openai_error(await client.get("/admin/v1/audit"), 401)
    assert_openai_error(await client.get("/admin/v1/audit", headers=bearer(secret)), 403)
    err = assert_openai_error(
        await client.get("/admin/v1/audit", headers=A, params={"limit": 0}), 400
    )
    assert "limit" in err["param"]
    err = assert_openai_error(
        await client.get("/admin/v1/audit", headers=A, params={"before": "x; DROP"}), 400
    )
    assert "before" in err["param"]


async def test_retention_trims_by_age_and_count(identity: Identity) -> None:
    redis: aioredis.Redis = identity.store.redis
    # An entry written two days ago (stream ids are Redis's milliseconds).
    two_days_ago_ms = int((time.time() - 2 * 86400) * 1000)
    await redis.xadd(STREAM_KEY, {"action": "tenant.create"}, id=f"{two_days_ago_ms}-0")
    log = AuditLog(redis, AuditSettings(retention_days=1, max_entries=3))
    actor = Actor("admin-x", "admin_key", "10.0.0.1")
    await log.record(actor, "tenant.create", "tenant:t0")
    entries, _ = await log.read()
    assert [e.target for e in entries] == ["tenant:t0"]  # the old entry is past retention
    for i in range(1, 5):
        await log.record(actor, "tenant.create", f"tenant:t{i}")
    assert await redis.xlen(STREAM_KEY) == 3  # max_entries
    entries, _ = await log.read()
    assert [e.target for e in entries] == ["tenant:t4", "tenant:t3", "tenant:t2"]
    # 0 and 0: no bound at all.
    unbounded = AuditLog(redis, AuditSettings(retention_days=0, max_entries=0))
    await unbounded.record(actor, "tenant.create", "tenant:t5")
    assert await redis.xlen(STREAM_KEY) == 4


async def test_a_redis_failure_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No retries: redis-py's default backs off for seconds before the error this test is about.
    broken = aioredis.Redis(
        unix_socket_path="/nonexistent/redis.sock", retry=Retry(NoBackoff(), retries=0)
    )
    log = AuditLog(broken)
    caplog.set_level(logging.INFO, logger="portico.audit")
    await log.record(Actor("admin-x", "admin_key", "::1"), "tenant.delete", "tenant:a")
    messages = [r.getMessage() for r in caplog.records if r.name == "portico.audit"]
    assert json.loads(messages[0])["action"] == "tenant.delete"  # the log line still went out
    assert "could not append" in messages[1]
    await broken.aclose()


async def test_a_sparse_filter_scans_a_bounded_stretch_per_page(
    identity: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.identity.audit as audit_module

    monkeypatch.setattr(audit_module, "SCAN_BATCH", 4)
    monkeypatch.setattr(audit_module, "MAX_SCAN", 8)
    log = AuditLog(identity.store.redis)
    actor = Actor("admin-x", "admin_key", "::1")
    await log.record(actor, "key.revoke", "key-a", tenant_id="rare")
    for i in range(12):
        await log.record(actor, "tenant.update", f"tenant:t{i}", tenant_id="common")
    # The one match is older than the first 8 entries: the first page is empty, with a cursor.
    first, cursor = await log.read(tenant_id="rare")
    assert first == [] and cursor is not None
    second, cursor = await log.read(tenant_id="rare", before=cursor)
    assert [e.target for e in second] == ["key-a"] and cursor is None
