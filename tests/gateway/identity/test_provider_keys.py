"""Tenants' provider keys: sealed at rest, bound to their slot, cached briefly (real Redis)."""

from __future__ import annotations

import redis.asyncio as aioredis

from gateway.identity.provider_keys import ProviderKeyStore, tenant_key

SECRET = b"k" * 32
KEY = "sk-provider-0123456789abcdefghij"


async def test_a_key_is_stored_sealed_and_read_back(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = ProviderKeyStore(client, SECRET, cache_ttl_s=0)
    await store.set("acme", "gpt", KEY)
    raw = await client.hget(tenant_key("acme"), "gpt")
    assert raw is not None and KEY.encode() not in raw
    assert await store.get("acme", "gpt") == KEY
    assert await store.get("acme", "other") is None
    listing = await store.listing("acme")
    assert [r["remote"] for r in listing] == ["gpt"] and KEY not in str(listing)
    assert await store.delete("acme", "gpt") and await store.get("acme", "gpt") is None
    assert not await store.delete("acme", "gpt")
    await client.aclose()


async def test_a_sealed_key_moved_to_another_slot_or_secret_does_not_open(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = ProviderKeyStore(client, SECRET, cache_ttl_s=0)
    await store.set("acme", "gpt", KEY)
    raw = await client.hget(tenant_key("acme"), "gpt")
    await client.hset(tenant_key("evil"), "gpt", raw)  # type: ignore[arg-type]
    await client.hset(tenant_key("acme"), "claude", raw)  # type: ignore[arg-type]
    assert await store.get("evil", "gpt") is None
    assert await store.get("acme", "claude") is None
    assert await ProviderKeyStore(client, b"x" * 32, cache_ttl_s=0).get("acme", "gpt") is None
    await client.aclose()


async def test_reads_are_cached_for_the_ttl_and_writes_here_invalidate(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    here = ProviderKeyStore(client, SECRET, cache_ttl_s=60)
    elsewhere = ProviderKeyStore(client, SECRET, cache_ttl_s=60)
    assert await here.get("acme", "gpt") is None  # absent: cached too
    await elsewhere.set("acme", "gpt", KEY)  # another replica
    assert await here.get("acme", "gpt") is None  # until the TTL passes
    await here.set("acme", "gpt", KEY + "2")  # a write here is seen here at once
    assert await here.get("acme", "gpt") == KEY + "2"
    await client.aclose()
