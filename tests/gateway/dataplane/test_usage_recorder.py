"""Batched usage recording against a real Redis: same totals as one-by-one, nothing lost when
Redis is down for a while, and a final flush on close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import pytest
import redis.asyncio as aioredis

from gateway.admission.redis_pipe import RedisPipe
from gateway.admission.usage_recorder import UsageRecorder
from gateway.identity.plans import load_plans
from gateway.identity.tenants import TenantStore

SECRET = b"s" * 32


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    yield c
    await c.aclose()


def today() -> datetime:
    return datetime.now(timezone.utc)


async def test_a_batch_lands_exactly_as_one_by_one_writes(client: aioredis.Redis) -> None:
    store = TenantStore(client, SECRET, load_plans())
    recorder = UsageRecorder(store.ledger, interval_s=3600)  # only explicit flushes in this test
    for i in range(50):
        recorder.record("acme", "m1" if i % 2 else "m2", 10, 3)
        await store.ledger.record_usage("other", "m1" if i % 2 else "m2", 10, 3)
    recorder.record("beta", "m1", 1, 1)
    await recorder.flush()
    day = today().date()
    acme = await store.ledger.usage("acme", day, day)
    other = await store.ledger.usage("other", day, day)
    assert acme.model_dump()["totals"] == other.model_dump()["totals"]
    assert acme.model_dump()["days"][0]["models"] == other.model_dump()["days"][0]["models"]
    assert acme.totals.requests == 50 and acme.totals.prompt_tokens == 500
    assert (await store.ledger.usage("beta", day, day)).totals.completion_tokens == 1
    ttl = await client.ttl(f"portico:usage:{{acme}}:{day.isoformat()}")
    assert ttl > 0


async def _records_outlive_an_outage(
    recorder: UsageRecorder, private_redis, store: TenantStore
) -> None:  # type: ignore[no-untyped-def]
    """Two records while Redis is down, each flush failing (kept, summed); once it is back the
    final flush writes both."""
    recorder.record("acme", "m", 5, 5)
    private_redis.stop()
    await recorder.flush()  # fails: kept
    recorder.record("acme", "m", 5, 5)
    await recorder.flush()  # fails again (refused): kept, summed
    private_redis.start()
    await recorder.aclose()  # the final flush writes both
    day = today().date()
    usage = await store.ledger.usage("acme", day, day)
    assert (usage.totals.requests, usage.totals.prompt_tokens) == (2, 10)


async def test_counts_survive_a_redis_outage_and_land_after_it(private_redis) -> None:  # type: ignore[no-untyped-def]
    c = aioredis.Redis.from_url(private_redis.url, socket_timeout=1, socket_connect_timeout=1)
    try:
        store = TenantStore(c, SECRET, load_plans())
        await _records_outlive_an_outage(
            UsageRecorder(store.ledger, interval_s=3600), private_redis, store
        )
    finally:
        await c.aclose()


async def test_the_background_loop_flushes_and_close_flushes_the_rest(
    client: aioredis.Redis,
) -> None:
    store = TenantStore(client, SECRET, load_plans())
    recorder = UsageRecorder(store.ledger, interval_s=0.05)
    recorder.start()
    recorder.record("acme", "m", 1, 2)
    day = today().date()
    for _ in range(200):  # bounded wait for the loop (no timing assertion)
        if (await store.ledger.usage("acme", day, day)).totals.requests == 1:
            break
        await asyncio.sleep(0.05)
    assert (await store.ledger.usage("acme", day, day)).totals.requests == 1
    recorder.record("acme", "m", 1, 2)
    await recorder.aclose()
    assert (await store.ledger.usage("acme", day, day)).totals.requests == 2


async def test_a_batch_over_the_pipe_lands_as_one_through_redis_py(client: aioredis.Redis) -> None:
    store = TenantStore(client, SECRET, load_plans())
    pipe = RedisPipe.from_client(client)
    assert pipe is not None
    try:
        piped = UsageRecorder(store.ledger, interval_s=3600, pipe=pipe)
        plain = UsageRecorder(store.ledger, interval_s=3600)
        for i in range(50):
            for recorder, tenant in ((piped, "acme"), (plain, "other")):
                recorder.record(
                    tenant,
                    f"m{i % 3}",
                    10,
                    3,
                    "estimate" if i % 5 else "upstream",
                    key_id=f"k{i % 2}",
                    cached_tokens=i,
                    spend_micro_usd=7,
                )
        await piped.flush()
        await plain.flush()
        day = today().date()
        acme = await client.hgetall(f"portico:usage:{{acme}}:{day.isoformat()}")
        other = await client.hgetall(f"portico:usage:{{other}}:{day.isoformat()}")
        assert acme == other and len(acme) > 20
        assert await client.ttl(f"portico:usage:{{acme}}:{day.isoformat()}") > 0
    finally:
        await pipe.aclose()


async def test_counts_over_the_pipe_survive_a_redis_outage(private_redis) -> None:  # type: ignore[no-untyped-def]
    c = aioredis.Redis.from_url(private_redis.url, socket_timeout=1, socket_connect_timeout=1)
    pipe = RedisPipe.from_client(c)
    assert pipe is not None
    try:
        store = TenantStore(c, SECRET, load_plans())
        recorder = UsageRecorder(store.ledger, interval_s=3600, pipe=pipe)
        assert await pipe.execute("PING") == b"PONG"  # connected: the outage cuts a live socket
        await _records_outlive_an_outage(recorder, private_redis, store)
    finally:
        await pipe.aclose()
        await c.aclose()
