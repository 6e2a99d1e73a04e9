"""The store underneath: embedded Redis lifecycle, plans file, secrets, concurrent updates."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.identity.auth import AuthSettings, load_admin_key, load_key_hash_secret
from gateway.identity.plans import LimitsSpec, Plan, load_plans
from gateway.identity.records import ApiKey, KeyCreate, Tenant, TenantCreate, TenantPatch
from gateway.identity.tenants import TenantStore
from gateway.store import StoreSettings, close_redis, open_redis
from portico.errors import PermissionDeniedError

SECRET = b"s" * 32


async def test_embedded_redis_stops_cleanly_and_keeps_its_data(tmp_path: Path) -> None:
    client, embedded = await open_redis(None, tmp_path)
    assert embedded is not None
    pid = embedded._server.pid
    socket_dir = Path(embedded.socket_path).parent
    await client.set("portico:probe", "1")
    await close_redis(client, embedded)
    assert not socket_dir.exists()
    try:
        assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    embedded.close()  # idempotent

    client, embedded = await open_redis(None, tmp_path)
    try:
        assert await client.get("portico:probe") == b"1"
    finally:
        await close_redis(client, embedded)


async def test_unreachable_redis_url_raises(tmp_path: Path) -> None:
    with pytest.raises(redis.ConnectionError):
        await open_redis(f"unix://{tmp_path}/missing.sock", tmp_path)


def test_store_settings_validate_the_url() -> None:
    assert StoreSettings(url="").url is None
    assert StoreSettings(url="redis://localhost:6379/0").url.startswith("redis://")
    with pytest.raises(ValueError, match="url"):
        StoreSettings(url="http://localhost")
    with pytest.raises(ValueError):
        StoreSettings(redis_url="redis://x")  # unknown field


def test_packaged_plans_load_with_default_first() -> None:
    plans = load_plans()
    assert list(plans)[0] == "free"
    assert set(plans) == {"free", "standard", "enterprise"}
    assert plans["free"].allowed_models == ["smollm2"]
    assert plans["standard"].model_limits["smollm2"].requests_per_minute == 600
    assert plans["enterprise"].monthly_token_budget is None


@pytest.mark.parametrize(
    "text,match",
    [
        ("plans: {free: {requests_per_minute: fast}}", "requests_per_minute"),
        ("plans: {free: {rpm: 5}}", "rpm"),
        ("plans: {}", "no plans"),
        ("default_plan: gold\nplans: {free: {}}", "gold"),
        ("plans: [", "invalid plans file"),
    ],
)
def test_bad_plans_files_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "plans.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_plans(path)
    assert str(path) in str(info.value)


def test_key_hash_secret_sources(tmp_path: Path) -> None:
    settings = AuthSettings()
    generated = load_key_hash_secret(settings, tmp_path, {})
    path = tmp_path / "key_hash_secret"
    assert path.stat().st_mode & 0o777 == 0o600 and len(generated) == 64
    assert load_key_hash_secret(settings, tmp_path, {}) == generated  # reused, not regenerated
    env_secret = "e" * 40
    assert (
        load_key_hash_secret(settings, tmp_path, {"PORTICO_KEY_HASH_SECRET": env_secret})
        == env_secret.encode()
    )
    file = tmp_path / "mine"
    file.write_text("f" * 40 + "\n")
    from_file = AuthSettings(key_hash_secret_file=file)
    assert load_key_hash_secret(from_file, tmp_path, {}) == b"f" * 40
    with pytest.raises(ValueError, match="at least 16"):
        load_key_hash_secret(settings, tmp_path, {"PORTICO_KEY_HASH_SECRET": "short"})


def test_admin_key_sources(tmp_path: Path) -> None:
    assert load_admin_key(AuthSettings(), {}) is None
    assert load_admin_key(AuthSettings(), {"PORTICO_ADMIN_KEY": "a" * 20}) == "a" * 20
    file = tmp_path / "admin"
    file.write_text("b" * 20 + "\n")
    assert load_admin_key(AuthSettings(admin_key_file=file), {"PORTICO_ADMIN_KEY": "x"}) == "b" * 20
    with pytest.raises(ValueError, match="at least 16"):
        load_admin_key(AuthSettings(), {"PORTICO_ADMIN_KEY": "short"})
    with pytest.raises(ValueError):
        AuthSettings(key_cache_ttl_seconds=120)


@pytest.fixture
async def store(redis_url: str) -> TenantStore:
    client = aioredis.Redis.from_url(redis_url)
    yield TenantStore(client, SECRET, load_plans())
    await client.aclose()


async def test_concurrent_patches_lose_no_update(store: TenantStore) -> None:
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    models = [f"model-{i}" for i in range(20)]
    await asyncio.gather(
        *[
            store.update_tenant(
                "acme", TenantPatch(model_limits={m: LimitsSpec(requests_per_minute=i)})
            )
            for i, m in enumerate(models)
        ]
    )
    tenant = await store.get_tenant("acme")
    assert tenant is not None
    assert {m: s.requests_per_minute for m, s in tenant.model_limits.items()} == {
        m: i for i, m in enumerate(models)
    }


async def test_concurrent_usage_is_counted_exactly(store: TenantStore) -> None:
    await asyncio.gather(*[store.ledger.record_usage("acme", "m", 3, 2) for _ in range(100)])
    from datetime import datetime, timezone

    today = datetime.now(timezone.utc).date()
    usage = await store.ledger.usage("acme", today, today)
    assert usage.totals.requests == 100 and usage.totals.total_tokens == 500
    assert usage.models["m"].prompt_tokens == 300


async def test_tenant_on_an_unconfigured_plan_is_refused(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        plans = load_plans()
        full = TenantStore(client, SECRET, plans)
        await full.create_tenant(TenantCreate(id="acme", name="Acme", plan="enterprise"))
        key, secret = await full.create_key("acme", KeyCreate())
        # The gateway restarts with a plans file that no longer has "enterprise".
        reduced = TenantStore(client, SECRET, {"free": plans["free"]})
        found = await reduced.lookup_key(secret)
        assert found is not None
        with pytest.raises(PermissionDeniedError):
            reduced.principal_for(found[1], found[0])
    finally:
        await client.aclose()


async def test_key_is_bound_to_the_hash_secret(store: TenantStore) -> None:
    """A store with another key-hash secret cannot resolve the key (the digest differs)."""
    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    _, secret = await store.create_key("acme", KeyCreate())
    assert await store.lookup_key(secret) is not None
    other = TenantStore(store.redis, b"o" * 32, store.plans)
    assert await other.lookup_key(secret) is None


def test_store_refuses_weak_secret_and_empty_plans() -> None:
    client = aioredis.Redis()
    with pytest.raises(ValueError):
        TenantStore(client, b"short", load_plans())
    with pytest.raises(ValueError):
        TenantStore(client, SECRET, {})


def test_no_generated_secret_is_world_readable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        load_key_hash_secret(AuthSettings(), tmp_path, {})
    finally:
        os.umask(old)
    assert (tmp_path / "key_hash_secret").stat().st_mode & 0o077 == 0


async def test_orphan_key_never_serves_a_recreated_tenant(store: TenantStore) -> None:
    """A key that outlived its tenant (a create_key racing a delete) stays dead when the id
    is reused: keys are bound to the tenant's per-creation uid."""
    from gateway.identity.auth import Authenticator
    from portico.errors import AuthenticationError

    await store.create_tenant(TenantCreate(id="acme", name="Acme"))
    _, secret = await store.create_key("acme", KeyCreate())
    # what the race leaves behind: the tenant record gone, its key still indexed
    await store.redis.delete("portico:tenant:{acme}")
    await store.redis.srem("portico:tenants", "acme")
    await store.create_tenant(TenantCreate(id="acme", name="New Acme"))
    found = await store.lookup_key(secret)
    assert found is not None and found[1] is None
    with pytest.raises(AuthenticationError):
        await Authenticator(store).resolve(f"Bearer {secret}")


_counts = st.one_of(st.none(), st.integers(min_value=0, max_value=10**9))
_limits = st.builds(
    LimitsSpec,
    requests_per_minute=_counts,
    tokens_per_minute=_counts,
    max_concurrency=_counts,
    monthly_token_budget=_counts,
    max_tokens_default=_counts,
)


@settings(max_examples=200, deadline=None)
@given(
    plan_limits=_limits,
    overrides=_limits,
    key_limits=st.one_of(st.none(), _limits),
    plan_models=st.one_of(st.none(), st.lists(st.sampled_from("abc"), unique=True)),
    tenant_models=st.one_of(st.none(), st.lists(st.sampled_from("abc"), unique=True)),
    plan_shares=st.booleans(),
    tenant_shares=st.one_of(st.none(), st.booleans()),
)
def test_principal_merges_plan_and_tenant(
    plan_limits: LimitsSpec,
    overrides: LimitsSpec,
    key_limits: LimitsSpec | None,
    plan_models: list[str] | None,
    tenant_models: list[str] | None,
    plan_shares: bool,
    tenant_shares: bool | None,
) -> None:
    """Every tenant override wins over the plan, every unset one inherits it; the tenant's
    model list and sharing flag replace the plan's when set."""
    plan = Plan(
        **plan_limits.model_dump(),
        name="p",
        allowed_models=plan_models,
        share_prefix_cache=plan_shares,
    )
    store = TenantStore(aioredis.Redis(), SECRET, {"p": plan})
    tenant = Tenant(
        id="t",
        name="T",
        plan="p",
        overrides=overrides,
        allowed_models=tenant_models,
        share_prefix_cache=tenant_shares,
    )
    key = ApiKey(
        id="key-1", tenant_id="t", display="sk-...x", digest="d", created=0, limits=key_limits
    )
    p = store.principal_for(tenant, key)
    for field in LimitsSpec.model_fields:
        override = getattr(overrides, field)
        expected = override if override is not None else getattr(plan_limits, field)
        assert getattr(p.limits, field) == expected
    models = tenant_models if tenant_models is not None else plan_models
    assert p.allowed_models == (frozenset(models) if models is not None else None)
    shares = tenant_shares if tenant_shares is not None else plan_shares
    assert (p.cache_salt == "shared:p") is shares
    assert p.key_limits == (key_limits.to_limits() if key_limits is not None else None)
