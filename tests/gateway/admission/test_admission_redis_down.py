"""Admission while its Redis is stopped, and its return once Redis is started again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.admission.admission import (
    Admission,
    AdmissionSettings,
    InsufficientQuotaError,
    LimitExceededError,
    Ticket,
)
from gateway.identity.principal import Principal
from portico.errors import ServiceUnavailableError

MakePrincipal = Callable[..., Principal]
PROBE_INTERVAL_S = 0.05


@pytest.fixture
async def down_client(private_redis, redis_client_factory) -> AsyncIterator[Redis]:  # type: ignore[no-untyped-def]
    client = redis_client_factory(private_redis.url)
    yield client
    await client.aclose()


def build(client: Redis, policy: str, replicas: int = 1) -> tuple[Admission, CollectorRegistry]:
    registry = CollectorRegistry()
    settings = AdmissionSettings(
        redis_down_policy=policy,
        replicas=replicas,
        probe_interval_seconds=PROBE_INTERVAL_S,
        redis_timeout_seconds=0.5,
    )
    return Admission(client, settings, registry=registry), registry


async def try_admit(admission: Admission, who: Principal) -> Ticket | None:
    try:
        return await admission.admit(who, "m", 1, 1)
    except LimitExceededError:
        return None


async def wait_until_back(admission: Admission, who: Principal) -> None:
    """Keep sending requests (each may start the background probe) until Redis is used again."""
    for _ in range(400):
        if admission.redis_up:
            return
        await try_admit(admission, who)
        await asyncio.sleep(PROBE_INTERVAL_S)
    pytest.fail("admission did not return to Redis after it came back")


def outage_logs(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    records = [r for r in caplog.records if r.name == "portico.admission"]
    down = sum("unreachable" in r.getMessage() for r in records)
    back = sum("reachable again" in r.getMessage() for r in records)
    return down, back


async def test_local_policy_enforces_this_replicas_share_then_returns_to_redis(
    private_redis, down_client: Redis, make_principal: MakePrincipal, caplog
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="portico.admission")
    admission, registry = build(down_client, "local", replicas=2)
    who = make_principal(requests_per_minute=10)
    assert await try_admit(admission, who) is not None  # on Redis

    private_redis.stop()
    admitted = [await try_admit(admission, who) for _ in range(12)]
    # this replica's share of 10/min with 2 replicas: a bucket of 5
    assert sum(t is not None for t in admitted) == 5
    assert not admission.redis_up
    assert registry.get_sample_value("portico_admission_redis_up") == 0
    assert registry.get_sample_value("portico_admission_degraded_total", {"policy": "local"}) == 12
    refused = admitted[-1] is None
    assert refused
    for ticket in admitted:
        if ticket is not None:
            await admission.settle(ticket, 1, 1)  # in-process buckets: no Redis involved

    private_redis.start()  # a fresh, empty Redis
    await wait_until_back(admission, who)
    assert registry.get_sample_value("portico_admission_redis_up") == 1
    ticket = await admission.admit(who, "m", 1, 1)
    assert await down_client.exists("portico:rl:{acme}:t:rpm") == 1
    await admission.release(ticket)
    assert outage_logs(caplog) == (1, 1)  # one line for the outage, one for the recovery
    await admission.aclose()


async def test_open_policy_admits_everything_while_redis_is_down(
    private_redis, down_client: Redis, make_principal: MakePrincipal, caplog
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="portico.admission")
    admission, registry = build(down_client, "open")
    who = make_principal(requests_per_minute=2, max_concurrency=1)
    held = await admission.admit(who, "m", 1, 1)
    private_redis.stop()
    tickets = [await admission.admit(who, "m", 1, 1) for _ in range(20)]
    assert all(t.headers == {} for t in tickets)
    for t in tickets:
        await admission.settle(t, 1, 1)
    await admission.release(held)  # its Redis is gone: no error, the lease would free it
    assert registry.get_sample_value("portico_admission_degraded_total", {"policy": "open"}) == 20
    assert outage_logs(caplog)[0] == 1
    await admission.aclose()


async def test_closed_policy_answers_503_while_redis_is_down(
    private_redis, down_client: Redis, make_principal: MakePrincipal
) -> None:  # type: ignore[no-untyped-def]
    admission, _ = build(down_client, "closed")
    who = make_principal(requests_per_minute=100)
    private_redis.stop()
    for _ in range(3):
        with pytest.raises(ServiceUnavailableError) as info:
            await admission.admit(who, "m", 1, 1)
        assert info.value.status_code == 503
        assert info.value.code == "rate_limiter_unavailable"
        assert info.value.headers["retry-after"] == "1"
    private_redis.start()
    for _ in range(400):
        try:
            await admission.admit(who, "m", 1, 1)
            break
        except ServiceUnavailableError:
            await asyncio.sleep(PROBE_INTERVAL_S)
    else:
        pytest.fail("admission stayed closed after Redis came back")
    assert admission.redis_up
    await admission.aclose()


async def test_down_redis_costs_one_failed_call_not_one_per_request(
    private_redis, down_client: Redis, make_principal: MakePrincipal
) -> None:  # type: ignore[no-untyped-def]
    admission, _ = build(down_client, "local")
    who = make_principal(requests_per_minute=1000)
    private_redis.stop()
    await try_admit(admission, who)
    calls = 0
    original = down_client.evalsha

    async def counting_evalsha(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await original(*args, **kwargs)

    down_client.evalsha = counting_evalsha  # type: ignore[method-assign]
    for _ in range(50):
        await try_admit(admission, who)
    assert calls == 0  # requests go straight to the fallback; only the probe touches Redis
    await admission.aclose()


async def test_an_outage_does_not_hand_a_spent_budget_back(
    private_redis, down_client: Redis, make_principal: MakePrincipal
) -> None:  # type: ignore[no-untyped-def]
    admission, _ = build(down_client, "local", replicas=2)
    who = make_principal(monthly_token_budget=1000)
    ticket = await admission.admit(who, "m", 500, 100)
    await admission.settle(ticket, 500, 300)  # 800 of 1000 spent, in Redis
    ticket = await admission.admit(who, "m", 1, 1)  # Redis reports 800 used
    await admission.release(ticket)

    private_redis.stop()
    # 200 are left in all; this replica may spend its half of that: 100
    ticket = await admission.admit(who, "m", 50, 10)
    await admission.settle(ticket, 50, 40)  # 90 of its 100
    ticket = await admission.admit(who, "m", 5, 5)
    await admission.settle(ticket, 5, 5)  # 100: its share is spent
    with pytest.raises(InsufficientQuotaError):
        await admission.admit(who, "m", 1, 1)
    await admission.aclose()
