"""API-key security: secrets never leak, admin key compared in constant time, data-plane keys
never reach /admin, revocation and expiry within the cache window, tenants isolated, and key
resolution costs at most one Redis round trip."""

from __future__ import annotations

import hmac
import logging

import httpx
import prometheus_client
import pytest
from identity_app import ADMIN_KEY, admin_headers, assert_openai_error, bearer, build_app
from redis.asyncio import RedisCluster

from gateway.identity.auth import Authenticator
from gateway.identity.records import KeyCreate, TenantCreate
from portico.errors import AuthenticationError, PermissionDeniedError

A = admin_headers()

ADMIN_ROUTES = [
    ("GET", "/admin/v1/plans", None),
    ("GET", "/admin/v1/tenants", None),
    ("POST", "/admin/v1/tenants", {"id": "evil", "name": "Evil"}),
    ("GET", "/admin/v1/tenants/victim", None),
    ("PATCH", "/admin/v1/tenants/victim", {"disabled": True}),
    ("DELETE", "/admin/v1/tenants/victim", None),
    ("POST", "/admin/v1/tenants/victim/keys", {}),
    ("GET", "/admin/v1/tenants/victim/keys", None),
    ("GET", "/admin/v1/tenants/victim/keys/{victim_key}", None),
    ("POST", "/admin/v1/tenants/victim/keys/{victim_key}/revoke", None),
    ("POST", "/admin/v1/tenants/victim/keys/{victim_key}/rotate", None),
    ("GET", "/admin/v1/tenants/victim/usage", None),
    ("PATCH", "/admin/v1/tenants/attacker", {"overrides": {"requests_per_minute": 10**9}}),
    ("POST", "/admin/v1/tenants/attacker/keys", {}),
]


class FakeClock:
    """A settable clock for cache ages and key expiry (no wall-clock waits in tests)."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


async def _command_calls(redis) -> dict[str, int]:
    """Commands the server has run, by name (on a cluster: summed over every master)."""
    if isinstance(redis, RedisCluster):
        per_node = await redis.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        calls: dict[str, int] = {}
        for stats in per_node.values():
            for name, v in stats.items():
                key = name.removeprefix("cmdstat_")
                calls[key] = calls.get(key, 0) + int(v["calls"])
        return calls
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


async def test_secret_never_appears_after_creation(
    client: httpx.AsyncClient, identity, make_tenant, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await make_tenant("acme")
    created = await client.post("/admin/v1/tenants/acme/keys", headers=A, json={"name": "k"})
    secret = created.json()["key"]
    rotated = await client.post(
        f"/admin/v1/tenants/acme/keys/{created.json()['id']}/rotate",
        headers=A,
        json={"grace_seconds": 60},
    )
    new_secret = rotated.json()["key"]
    secrets_ = [secret, new_secret]

    later: list[httpx.Response] = []
    later.append(await client.get("/v1/whoami", headers=bearer(secret)))
    later.append(await client.get("/v1/whoami", headers=bearer(secret + "x")))
    later.append(await client.get("/v1/whoami", headers={"Authorization": secret}))
    later.append(await client.get("/admin/v1/tenants", headers=bearer(secret)))
    later.append(await client.get("/admin/v1/tenants/acme/keys", headers=A))
    later.append(await client.get(f"/admin/v1/tenants/acme/keys/{created.json()['id']}", headers=A))
    later.append(await client.get("/admin/v1/tenants/acme", headers=A))
    later.append(await client.get("/admin/v1/tenants/acme/usage", headers=A))
    later.append(
        await client.post(f"/admin/v1/tenants/acme/keys/{rotated.json()['id']}/revoke", headers=A)
    )
    later.append(await client.get("/v1/whoami", headers=bearer(new_secret)))
    later.append(await client.get("/openapi.json"))
    assert later[0].status_code == 200 and later[1].status_code == 401

    metrics = prometheus_client.generate_latest().decode()
    redis_dump = b"".join(
        [k + (await identity.redis.dump(k) or b"") for k in await identity.redis.keys("*")]
    )
    for s in secrets_:
        for resp in later:
            assert s not in resp.text and s not in str(resp.headers)
        assert s not in caplog.text
        assert s[3:] not in caplog.text
        assert s not in metrics
        assert s.encode() not in redis_dump and s[3:].encode() not in redis_dump
    assert ADMIN_KEY not in caplog.text
    # The change itself is logged (the audit log's JSON line), without any secret.
    audit_lines = [r.getMessage() for r in caplog.records if r.name == "portico.audit"]
    assert any('"action": "key.create"' in line for line in audit_lines)


async def test_admin_key_compared_in_constant_time(
    client: httpx.AsyncClient, identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every admin-key check goes through hmac.compare_digest over fixed-size digests (so
    neither the content nor the length of a guess shows in timing), and the key itself is
    not kept in the authenticator."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):  # type: ignore[no-untyped-def]
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    for guess in ("short", ADMIN_KEY[:-1] + "x", ADMIN_KEY + "extra", ADMIN_KEY.upper()):
        assert_openai_error(await client.get("/admin/v1/tenants", headers=bearer(guess)), 401)
    assert (await client.get("/admin/v1/tenants", headers=A)).status_code == 200
    assert len(calls) >= 5
    assert all(len(a) == len(b) == 32 for a, b in calls[:5])
    auth = identity.authenticator
    assert ADMIN_KEY not in repr(vars(auth)) and ADMIN_KEY.encode() not in repr(vars(auth)).encode()


async def test_admin_api_refuses_missing_and_wrong_credentials(
    client: httpx.AsyncClient,
) -> None:
    assert_openai_error(await client.get("/admin/v1/tenants"), 401)
    assert_openai_error(
        await client.get("/admin/v1/tenants", headers={"Authorization": "Basic x"}), 401
    )
    assert_openai_error(
        await client.get("/admin/v1/tenants", headers={"Authorization": f"Token {ADMIN_KEY}"}), 401
    )
    # Unauthenticated garbage gets 401, not a validation error that would reveal the schema.
    resp = await client.post(
        "/admin/v1/tenants", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert_openai_error(resp, 401)


async def test_data_plane_keys_never_reach_admin(
    client: httpx.AsyncClient, identity, make_tenant, make_key
) -> None:
    """Every admin route, called with another tenant's valid key: 403, and nothing changes."""
    await make_tenant("victim")
    await make_tenant("attacker")
    victim_key = await make_key("victim")
    attacker_key = (await make_key("attacker"))["key"]
    before = {k: await identity.redis.dump(k) for k in await identity.redis.keys("portico:*")}

    for method, path, body in ADMIN_ROUTES:
        resp = await client.request(
            method,
            path.format(victim_key=victim_key["id"]),
            headers=bearer(attacker_key),
            json=body,
        )
        err = assert_openai_error(resp, 403)
        assert err["type"] == "permission_error", path
    after = {k: await identity.redis.dump(k) for k in await identity.redis.keys("portico:*")}
    assert after == before
    assert (await client.get("/v1/whoami", headers=bearer(victim_key["key"]))).status_code == 200


async def test_admin_cannot_cross_tenants_by_path(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    """A key id addressed under the wrong tenant is 404, and the key is untouched."""
    await make_tenant("a")
    await make_tenant("b")
    b_key = await make_key("b")
    for action in ("", "/revoke", "/rotate"):
        method = "GET" if not action else "POST"
        resp = await client.request(
            method, f"/admin/v1/tenants/a/keys/{b_key['id']}{action}", headers=A
        )
        assert_openai_error(resp, 404)
    assert (await client.get("/admin/v1/tenants/a/keys", headers=A)).json()["data"] == []
    me = await client.get("/v1/whoami", headers=bearer(b_key["key"]))
    assert me.status_code == 200 and me.json()["tenant_id"] == "b"


async def test_tenants_get_distinct_cache_salts_unless_shared(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("a")
    await make_tenant("b")
    await make_tenant("c", share_prefix_cache=True, plan="standard")
    await make_tenant("d", share_prefix_cache=True, plan="standard")
    salts = {}
    for t in "abcd":
        key = (await make_key(t))["key"]
        salts[t] = (await client.get("/v1/whoami", headers=bearer(key))).json()["cache_salt"]
    assert salts["a"] != salts["b"] and len(salts["a"]) == 32
    assert salts["c"] == salts["d"] == "shared:standard"


async def test_revocation_on_another_replica_takes_effect_within_the_ttl(identity) -> None:
    """Two authenticators share one Redis (two gateway replicas). Replica 2 caches the key;
    replica 1 revokes it. Replica 2 refuses it once its cache entry is older than the TTL."""
    store = identity.store
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    key, secret = await store.create_key("acme", KeyCreate())
    clock = FakeClock(1000.0)
    replica2 = Authenticator(store, cache_ttl_seconds=2.0, clock=clock)
    assert (await replica2.resolve(f"Bearer {secret}")).key_id == key.id

    await store.revoke_key("acme", key.id)
    clock.now += 1.9
    assert (await replica2.resolve(f"Bearer {secret}")).key_id == key.id  # still cached
    clock.now += 0.2
    with pytest.raises(AuthenticationError):
        await replica2.resolve(f"Bearer {secret}")

    uncached = Authenticator(store, cache_ttl_seconds=0)
    await store.revoke_key("acme", (await store.create_key("acme", KeyCreate()))[0].id)
    with pytest.raises(AuthenticationError):
        await uncached.resolve(f"Bearer {secret}")


async def test_expiry_is_enforced_even_for_a_cached_key(identity) -> None:
    store = identity.store
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    key, secret = await store.create_key("acme", KeyCreate(expires_in_seconds=60))
    wall = FakeClock(float(key.created))
    auth = Authenticator(store, cache_ttl_seconds=30.0, clock=FakeClock(0.0), wall_clock=wall)
    assert (await auth.resolve(f"Bearer {secret}")).tenant_id == "acme"
    wall.now = key.created + 61
    with pytest.raises(AuthenticationError):
        await auth.resolve(f"Bearer {secret}")


async def test_key_resolution_is_one_round_trip_and_cache_hits_are_free(identity) -> None:
    """Counted on the server: a miss is exactly one EVALSHA (whose script reads the digest
    index and both records); a cache hit sends nothing. On a cluster the digest index and the
    tenant's records live in different slots: a miss is an HMGET and one MGET."""
    if isinstance(identity.redis, RedisCluster):
        await _two_round_trips_on_a_cluster(identity)
        return
    store = identity.store
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    _, secret = await store.create_key("acme", KeyCreate())
    clock = FakeClock(0.0)
    auth = Authenticator(store, cache_ttl_seconds=2.0, clock=clock)
    redis = identity.redis
    with pytest.raises(AuthenticationError):  # loads the script once (SCRIPT LOAD on NOSCRIPT)
        await auth.resolve("Bearer sk-" + "x" * 43)

    c0 = await _command_calls(redis)
    await auth.resolve(f"Bearer {secret}")
    c1 = await _command_calls(redis)
    assert _delta(c0, c1) == {"evalsha": 1, "hmget": 1, "get": 2, "info": 1}
    for _ in range(50):
        await auth.resolve(f"Bearer {secret}")
    c2 = await _command_calls(redis)
    assert _delta(c1, c2) == {"info": 1}
    with pytest.raises(AuthenticationError):
        await auth.resolve("Bearer sk-" + "y" * 43)
    assert _delta(c2, await _command_calls(redis)) == {"evalsha": 1, "hmget": 1, "info": 1}
    clock.now = 2.5  # the entry aged out: one round trip again
    c3 = await _command_calls(redis)
    await auth.resolve(f"Bearer {secret}")
    assert _delta(c3, await _command_calls(redis))["evalsha"] == 1


async def test_key_of_a_disabled_tenant_is_refused_after_ttl_on_other_replica(
    identity,
) -> None:
    store = identity.store
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    _, secret = await store.create_key("acme", KeyCreate())
    clock = FakeClock(0.0)
    other = Authenticator(store, cache_ttl_seconds=2.0, clock=clock)
    await other.resolve(f"Bearer {secret}")
    from gateway.identity.records import TenantPatch

    await store.update_tenant("acme", TenantPatch(disabled=True))
    clock.now = 2.5
    with pytest.raises(PermissionDeniedError):
        await other.resolve(f"Bearer {secret}")


async def test_malformed_authorization_headers(client: httpx.AsyncClient) -> None:
    for header in (
        "",
        "Bearer",
        "Bearer ",
        "bearer  sk-",
        "sk-abc",
        "Bearer a b",
        "Bearer " + "x" * 9000,
        "Bearer sk-" + "\u00e9" * 10,
    ):
        resp = await client.get("/v1/whoami", headers={"Authorization": header.encode()})
        assert_openai_error(resp, 401)
    assert_openai_error(await client.get("/v1/whoami"), 401)
    # The admin key is not a data-plane credential.
    assert_openai_error(await client.get("/v1/whoami", headers=A), 401)


async def test_build_app_over_second_authenticator_shares_state(identity) -> None:
    """The router works over any authenticator of the same store (what the dataplane does)."""
    other = Authenticator(identity.store, admin_key=ADMIN_KEY)
    transport = httpx.ASGITransport(app=build_app(other))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        resp = await c.post("/admin/v1/tenants", headers=A, json={"id": "z", "name": "Z"})
        assert resp.status_code == 201
    assert await identity.store.get_tenant("z") is not None


async def test_before_auth_hook_runs_before_the_credential_check(identity) -> None:
    """The per-address admin limit (the dataplane's abuse guard) must see failed guesses."""
    from fastapi import FastAPI, Request

    from gateway.identity.admin import build_admin_router
    from portico.errors import RateLimitError
    from portico.http_errors import install_error_handlers

    seen: list[str] = []

    async def limit(request: Request) -> None:
        seen.append(request.headers.get("authorization", ""))
        if len(seen) > 3:
            raise RateLimitError("Too many admin requests from this address.")

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(
        build_admin_router(identity.store, identity.authenticator, before_auth=limit)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        for _ in range(3):
            assert_openai_error(await c.get("/admin/v1/tenants", headers=bearer("guess" * 4)), 401)
        assert_openai_error(await c.get("/admin/v1/tenants", headers=A), 429)
    assert len(seen) == 4


async def test_redis_outage_is_503_and_recovers(private_redis, tmp_path) -> None:
    """With Redis down a credential cannot be checked: 503 (never a 500, never a pass), on the
    data plane and on the admin API; when Redis is back, the same key works again."""
    from gateway.identity.auth import AuthSettings, open_identity
    from gateway.store import StoreSettings, open_shared_redis

    settings = StoreSettings(url=private_redis.url, data_dir=tmp_path)
    env = {"PORTICO_ADMIN_KEY": ADMIN_KEY}
    redis = await open_shared_redis(settings, env)
    ident = open_identity(redis.client, settings, AuthSettings(key_cache_ttl_seconds=0), env)
    try:
        transport = httpx.ASGITransport(app=build_app(ident.authenticator))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            await c.post("/admin/v1/tenants", headers=A, json={"id": "acme", "name": "Acme"})
            secret = (await c.post("/admin/v1/tenants/acme/keys", headers=A, json={})).json()
            private_redis.stop()
            resp = await c.get("/v1/whoami", headers=bearer(secret["key"]))
            assert assert_openai_error(resp, 503)["type"] == "service_unavailable"
            assert resp.headers["retry-after"] == "1"
            assert_openai_error(await c.get("/admin/v1/tenants", headers=A), 503)
            private_redis.start()  # empty again (no persistence): recreate and retry
            await c.post("/admin/v1/tenants", headers=A, json={"id": "acme", "name": "Acme"})
            again = (await c.post("/admin/v1/tenants/acme/keys", headers=A, json={})).json()
            assert (await c.get("/v1/whoami", headers=bearer(again["key"]))).status_code == 200
    finally:
        await ident.aclose()
        await redis.aclose()


async def _two_round_trips_on_a_cluster(identity) -> None:
    store = identity.store
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    _, secret = await store.create_key("acme", KeyCreate())
    clock = FakeClock(0.0)
    auth = Authenticator(store, cache_ttl_seconds=2.0, clock=clock)
    c0 = await _command_calls(identity.redis)
    assert (await auth.resolve(f"Bearer {secret}")).tenant_id == "acme"
    c1 = await _command_calls(identity.redis)
    assert _delta(c0, c1) == {"hmget": 1, "mget": 1, "info": 3}
    for _ in range(50):
        await auth.resolve(f"Bearer {secret}")
    assert _delta(c1, await _command_calls(identity.redis)) == {"info": 3}
    with pytest.raises(AuthenticationError):
        await auth.resolve("Bearer sk-" + "y" * 43)  # no such digest: the index answers alone


def test_a_token_with_any_whitespace_inside_is_refused() -> None:
    from gateway.identity.auth import _bearer

    for space in (" ", "\t", "\u00a0", "\u2003", "\u3000", "\x1c", "\x85"):
        assert space.isspace()
        with pytest.raises(AuthenticationError):
            _bearer(f"Bearer sk-a{space}b")
    assert _bearer(" Bearer  sk-ab\u2003") == "sk-ab"
