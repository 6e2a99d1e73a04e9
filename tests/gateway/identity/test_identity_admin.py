"""Every admin operation through HTTP, against a real redis-server and the embedded Redis."""

from __future__ import annotations

from pathlib import Path

import httpx
from identity_app import admin_headers, assert_openai_error, bearer, build_app

from gateway.identity.auth import AuthSettings, open_identity
from gateway.store import StoreSettings, open_shared_redis

A = admin_headers()


async def test_tenant_crud_roundtrip(client: httpx.AsyncClient, make_tenant) -> None:
    created = await make_tenant("acme", plan="standard", allowed_models=["smollm2-135m"])
    assert created["id"] == "acme" and created["plan"] == "standard"
    assert created["effective"]["allowed_models"] == ["smollm2-135m"]
    assert created["effective"]["limits"]["requests_per_minute"] == 600

    listed = (await client.get("/admin/v1/tenants", headers=A)).json()
    assert [t["id"] for t in listed["data"]] == ["acme"]
    got = (await client.get("/admin/v1/tenants/acme", headers=A)).json()
    assert got["name"] == "Acme"

    resp = await client.patch(
        "/admin/v1/tenants/acme", headers=A, json={"name": "Acme Corp", "plan": "enterprise"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["name"] == "Acme Corp" and resp.json()["plan"] == "enterprise"

    resp = await client.delete("/admin/v1/tenants/acme", headers=A)
    assert resp.status_code == 204
    assert_openai_error(await client.get("/admin/v1/tenants/acme", headers=A), 404)
    assert (await client.get("/admin/v1/tenants", headers=A)).json()["data"] == []


async def test_tenant_without_id_gets_one_and_default_plan(client: httpx.AsyncClient) -> None:
    resp = await client.post("/admin/v1/tenants", headers=A, json={"name": "No Id"})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["id"].startswith("t-") and body["plan"] == "free"


async def test_duplicate_tenant_is_409(client: httpx.AsyncClient, make_tenant) -> None:
    await make_tenant("acme")
    resp = await client.post("/admin/v1/tenants", headers=A, json={"id": "acme", "name": "x"})
    err = assert_openai_error(resp, 409)
    assert err["param"] == "id"


async def test_unknown_plan_is_400_naming_plan(client: httpx.AsyncClient, make_tenant) -> None:
    resp = await client.post(
        "/admin/v1/tenants", headers=A, json={"id": "acme", "name": "x", "plan": "platinum"}
    )
    assert assert_openai_error(resp, 400)["param"] == "plan"
    await make_tenant("acme")
    resp = await client.patch("/admin/v1/tenants/acme", headers=A, json={"plan": "platinum"})
    assert assert_openai_error(resp, 400)["param"] == "plan"


async def test_key_create_list_and_use(client: httpx.AsyncClient, make_tenant, make_key) -> None:
    await make_tenant("acme", plan="standard")
    created = await make_key("acme", name="ci", scopes=["inference"])
    secret = created["key"]
    assert secret.startswith("sk-") and len(secret) >= 3 + 43
    assert created["display"] == f"sk-...{secret[-4:]}"
    assert created["status"] == "active" and "digest" not in created

    who = await client.get("/v1/whoami", headers=bearer(secret))
    assert who.status_code == 200, who.text
    me = who.json()
    assert me["tenant_id"] == "acme" and me["key_id"] == created["id"]
    assert me["plan"] == "standard" and me["scopes"] == ["inference"]
    assert me["model_limits"]["smollm2"]["requests_per_minute"] == 600

    listed = (await client.get("/admin/v1/tenants/acme/keys", headers=A)).json()["data"]
    assert [k["id"] for k in listed] == [created["id"]]
    assert "key" not in listed[0] and "digest" not in listed[0]
    one = (await client.get(f"/admin/v1/tenants/acme/keys/{created['id']}", headers=A)).json()
    assert one["name"] == "ci" and "key" not in one


async def test_revoke_refuses_the_key(client: httpx.AsyncClient, make_tenant, make_key) -> None:
    await make_tenant("acme")
    key = await make_key("acme")
    assert (await client.get("/v1/whoami", headers=bearer(key["key"]))).status_code == 200
    resp = await client.post(f"/admin/v1/tenants/acme/keys/{key['id']}/revoke", headers=A)
    assert resp.status_code == 200 and resp.json()["status"] == "revoked"
    # The router invalidates this process's cache, so the very next request is refused.
    assert_openai_error(await client.get("/v1/whoami", headers=bearer(key["key"])), 401)


async def test_rotate_issues_new_secret_and_revokes_old(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme")
    old = await make_key("acme", name="svc", scopes=["inference", "models:read"])
    resp = await client.post(f"/admin/v1/tenants/acme/keys/{old['id']}/rotate", headers=A)
    assert resp.status_code == 201, resp.text
    new = resp.json()
    assert new["key"] != old["key"] and new["replaces"] == old["id"]
    assert new["name"] == "svc" and new["scopes"] == ["inference", "models:read"]
    assert_openai_error(await client.get("/v1/whoami", headers=bearer(old["key"])), 401)
    me = (await client.get("/v1/whoami", headers=bearer(new["key"]))).json()
    assert me["key_id"] == new["id"]
    listed = {
        k["id"]: k
        for k in (await client.get("/admin/v1/tenants/acme/keys", headers=A)).json()["data"]
    }
    assert listed[old["id"]]["status"] == "revoked"
    assert listed[old["id"]]["replaced_by"] == new["id"]
    # A revoked key cannot be rotated again.
    resp = await client.post(f"/admin/v1/tenants/acme/keys/{old['id']}/rotate", headers=A)
    assert_openai_error(resp, 400)


async def test_rotate_with_grace_keeps_old_key_working(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme")
    old = await make_key("acme")
    resp = await client.post(
        f"/admin/v1/tenants/acme/keys/{old['id']}/rotate", headers=A, json={"grace_seconds": 3600}
    )
    new = resp.json()
    assert (await client.get("/v1/whoami", headers=bearer(old["key"]))).status_code == 200
    assert (await client.get("/v1/whoami", headers=bearer(new["key"]))).status_code == 200
    old_view = (await client.get(f"/admin/v1/tenants/acme/keys/{old['id']}", headers=A)).json()
    assert old_view["status"] == "active" and old_view["revoked_at"] is not None


async def test_quota_overrides_reach_the_principal(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme", plan="free")
    key = await make_key("acme", limits={"requests_per_minute": 5, "max_concurrency": 1})
    resp = await client.patch(
        "/admin/v1/tenants/acme",
        headers=A,
        json={
            "overrides": {
                "requests_per_minute": 100,
                "tokens_per_minute": 5000,
                "max_concurrency": 3,
                "monthly_token_budget": 42,
                "budget_usd": 25,
                "budget_period": "daily",
            },
            "allowed_models": ["smollm2-135m", "gpt-4o-mini"],
            "model_limits": {"gpt-4o-mini": {"requests_per_minute": 7}},
        },
    )
    assert resp.status_code == 200, resp.text
    eff = resp.json()["effective"]
    assert eff["limits"]["requests_per_minute"] == 100
    assert eff["limits"]["max_tokens_default"] == 512  # untouched: the free plan's number
    me = (await client.get("/v1/whoami", headers=bearer(key["key"]))).json()
    assert me["limits"] == {
        "requests_per_minute": 100,
        "tokens_per_minute": 5000,
        "max_concurrency": 3,
        "monthly_token_budget": 42,
        "max_tokens_default": 512,
        "budget_usd": 25.0,
        "budget_period": "daily",
    }
    assert eff["limits"]["budget_usd"] == 25.0 and eff["limits"]["budget_period"] == "daily"
    assert me["key_limits"]["requests_per_minute"] == 5
    assert me["key_limits"]["max_concurrency"] == 1
    assert me["allowed_models"] == ["gpt-4o-mini", "smollm2-135m"]
    assert me["model_limits"] == {
        "gpt-4o-mini": {
            "requests_per_minute": 7,
            "tokens_per_minute": None,
            "max_concurrency": None,
            "monthly_token_budget": None,
            "max_tokens_default": None,
            "budget_usd": None,
            "budget_period": None,
        }
    }

    # null clears one override; allowed_models null inherits the plan's list again.
    resp = await client.patch(
        "/admin/v1/tenants/acme",
        headers=A,
        json={"overrides": {"requests_per_minute": None}, "allowed_models": None},
    )
    me = (await client.get("/v1/whoami", headers=bearer(key["key"]))).json()
    assert me["limits"]["requests_per_minute"] == 20  # the free plan's
    assert me["limits"]["tokens_per_minute"] == 5000
    assert me["allowed_models"] == ["smollm2"]


async def test_disabled_tenant_is_refused(client: httpx.AsyncClient, make_tenant, make_key) -> None:
    await make_tenant("acme")
    key = await make_key("acme")
    await client.patch("/admin/v1/tenants/acme", headers=A, json={"disabled": True})
    err = assert_openai_error(await client.get("/v1/whoami", headers=bearer(key["key"])), 403)
    assert err["code"] == "tenant_disabled"
    await client.patch("/admin/v1/tenants/acme", headers=A, json={"disabled": False})
    assert (await client.get("/v1/whoami", headers=bearer(key["key"]))).status_code == 200


async def test_deleting_a_tenant_kills_its_keys(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme")
    key = await make_key("acme")
    await client.delete("/admin/v1/tenants/acme", headers=A)
    await make_tenant("acme")  # the same id again must not revive the old key
    assert_openai_error(await client.get("/v1/whoami", headers=bearer(key["key"])), 401)
    assert (await client.get("/admin/v1/tenants/acme/keys", headers=A)).json()["data"] == []


async def test_usage_per_model_per_day(client: httpx.AsyncClient, identity, make_tenant) -> None:
    await make_tenant("acme")
    await make_tenant("other")
    store = identity.store
    await store.ledger.record_usage("acme", "smollm2-135m", 10, 5)
    await store.ledger.record_usage("acme", "smollm2-135m", 20, 7)
    await store.ledger.record_usage("acme", "gpt-4o-mini", 3, 1)
    await store.ledger.record_usage("other", "smollm2-135m", 1000, 1000)
    resp = await client.get("/admin/v1/tenants/acme/usage", headers=A)
    assert resp.status_code == 200, resp.text
    usage = resp.json()
    assert usage["totals"] == {
        "requests": 3,
        "prompt_tokens": 33,
        "completion_tokens": 13,
        "total_tokens": 46,
        "cached_tokens": 0,
        "spend_micro_usd": 0,
        "spend_usd": 0.0,
        # requests whose output the gateway counted itself (the upstream reported no usage)
        "requests_counted_tokenizer": 0,
        "requests_counted_estimate": 0,
    }
    assert usage["models"]["smollm2-135m"]["requests"] == 2
    assert usage["models"]["gpt-4o-mini"]["prompt_tokens"] == 3
    assert len(usage["days"]) == 1 and usage["days"][0]["requests"] == 3
    ttl = await identity.redis.ttl(f"portico:usage:{{acme}}:{usage['days'][0]['date']}")
    assert ttl > 300 * 86400

    resp = await client.get(
        "/admin/v1/tenants/acme/usage?start=2020-01-01&end=2020-01-31", headers=A
    )
    assert resp.json()["days"] == [] and resp.json()["totals"]["requests"] == 0
    bad = await client.get(
        "/admin/v1/tenants/acme/usage?start=2020-02-01&end=2020-01-01", headers=A
    )
    assert_openai_error(bad, 400)
    bad = await client.get(
        "/admin/v1/tenants/acme/usage?start=2020-01-01&end=2022-01-01", headers=A
    )
    assert_openai_error(bad, 400)
    assert_openai_error(await client.get("/admin/v1/tenants/nope/usage", headers=A), 404)


async def test_plans_are_listed(client: httpx.AsyncClient) -> None:
    body = (await client.get("/admin/v1/plans", headers=A)).json()
    assert body["default"] == "free"
    assert {p["name"] for p in body["data"]} == {"free", "standard", "enterprise"}


async def test_openapi_documents_the_admin_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert "/admin/v1/tenants" in paths
    assert "/admin/v1/tenants/{tenant_id}/keys/{key_id}/rotate" in paths
    assert "/admin/v1/tenants/{tenant_id}/usage" in paths
    own = await client.get("/admin/v1/openapi.json", headers=A)
    assert own.status_code == 200
    assert set(own.json()["paths"]) == {p for p in paths if p.startswith("/admin/v1/")}
    assert "TenantCreate" in own.json()["components"]["schemas"]
    assert_openai_error(await client.get("/admin/v1/openapi.json"), 401)


async def test_state_survives_a_restart_of_the_embedded_redis(tmp_path: Path) -> None:
    """Create a tenant and key, close everything, reopen the same data dir: the key works."""
    env = {"PORTICO_ADMIN_KEY": "adm-" + "k" * 40}
    settings = StoreSettings(url=None, data_dir=tmp_path / "data")
    auth = AuthSettings()

    redis = await open_shared_redis(settings, env)
    ident = open_identity(redis.client, settings, auth, env)
    transport = httpx.ASGITransport(app=build_app(ident.authenticator))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        await c.post("/admin/v1/tenants", headers=A, json={"id": "acme", "name": "Acme"})
        key = (await c.post("/admin/v1/tenants/acme/keys", headers=A, json={})).json()
        revoked = (await c.post("/admin/v1/tenants/acme/keys", headers=A, json={})).json()
        await c.post(f"/admin/v1/tenants/acme/keys/{revoked['id']}/revoke", headers=A)
    salt_before = ident.store.tenant_salt("acme")
    await ident.aclose()
    await redis.aclose()
    assert (tmp_path / "data" / "key_hash_secret").stat().st_mode & 0o777 == 0o600

    redis = await open_shared_redis(settings, env)
    ident = open_identity(redis.client, settings, auth, env)
    try:
        assert ident.store.tenant_salt("acme") == salt_before  # same persisted secret
        transport = httpx.ASGITransport(app=build_app(ident.authenticator))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            me = await c.get("/v1/whoami", headers=bearer(key["key"]))
            assert me.status_code == 200, me.text
            assert me.json()["tenant_id"] == "acme"
            assert_openai_error(await c.get("/v1/whoami", headers=bearer(revoked["key"])), 401)
            tenants = (await c.get("/admin/v1/tenants", headers=A)).json()["data"]
            assert [t["id"] for t in tenants] == ["acme"]
    finally:
        await ident.aclose()
        await redis.aclose()
