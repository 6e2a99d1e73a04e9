"""Admission against a real Redis on the production path (Redis TIME as the clock)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import redis.exceptions
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.admission.admission import (
    Admission,
    AdmissionSettings,
    InsufficientQuotaError,
    LimitExceededError,
    format_duration,
    utc_month,
)
from gateway.admission.limiter import LUA_SOURCE
from gateway.identity.principal import Limits, Principal
from portico.errors import RateLimitError, ServiceUnavailableError

MakePrincipal = Callable[..., Principal]


@pytest.fixture
async def admission(redis_client: Redis) -> AsyncIterator[Admission]:
    adm = Admission(redis_client, AdmissionSettings(), registry=CollectorRegistry())
    yield adm
    await adm.aclose()


async def snapshot(redis: Redis) -> dict[bytes, object]:
    """Every key's type and content (not TTLs, which tick)."""
    state: dict[bytes, object] = {}
    for key in sorted(await redis.keys("*")):
        kind = await redis.type(key)
        if kind == b"hash":
            state[key] = await redis.hgetall(key)
        elif kind == b"zset":
            state[key] = await redis.zrange(key, 0, -1, withscores=True)
        else:
            state[key] = await redis.get(key)
    return state


async def tokens_in(redis: Redis, key: str) -> float:
    return float((await redis.hget(key, "t")) or b"nan")


def test_durations_are_written_like_openai() -> None:
    assert format_duration(0) == "0ms"
    assert format_duration(20) == "20ms"
    assert format_duration(1000) == "1s"
    assert format_duration(1500) == "1.5s"
    assert format_duration(6_600) == "6.6s"
    assert format_duration(360_000) == "6m0s"
    assert format_duration(61_250) == "1m1.25s"
    assert format_duration(3_600_000) == "1h0m0s"


def test_settings_name_the_bad_field() -> None:
    with pytest.raises(ValidationError, match="redis_down_policy"):
        AdmissionSettings(redis_down_policy="sometimes")
    with pytest.raises(ValidationError, match="replicas"):
        AdmissionSettings(replicas=0)
    with pytest.raises(ValidationError, match="failed_auth"):
        AdmissionSettings.model_validate({"abuse": {"failed_auth": "ten per fortnight"}})


async def test_admitted_response_carries_openai_headers(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=60, tokens_per_minute=6000)
    ticket = await admission.admit(who, "m", prompt_tokens=100, max_tokens=500)
    assert ticket.reserved_tokens == 600
    h = ticket.headers
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "59"
    assert h["x-ratelimit-reset-requests"] in ("1s", "999ms", "998ms")
    assert h["x-ratelimit-limit-tokens"] == "6000"
    assert h["x-ratelimit-remaining-tokens"] == "5400"
    assert h["x-ratelimit-reset-tokens"] in ("6s", "5.999s", "5.998s")
    await admission.settle(ticket, 100, 500)


async def test_refusal_names_the_limit_and_scope_with_exact_retry_after(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=2)
    for _ in range(2):
        await admission.release(await admission.admit(who, "m", 1, 1))
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(who, "m", 1, 1)
    err = info.value
    assert err.status_code == 429
    assert err.code == "rate_limit_exceeded"
    assert (err.limit, err.scope) == ("requests_per_minute", "tenant")
    assert "requests_per_minute" in err.message and "tenant 'acme'" in err.message
    # 2 per minute: one more in 30 s
    assert 29_000 < int(err.headers["retry-after-ms"]) <= 30_000
    assert err.headers["retry-after"] == "30"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    body = err.to_dict()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"


async def test_key_and_model_limits_are_enforced_and_named(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    who = make_principal(
        requests_per_minute=100,
        key_limits=Limits(requests_per_minute=1),
        model_limits={"big": Limits(tokens_per_minute=1000)},
    )
    await admission.admit(who, "small", 1, 1)
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(who, "small", 1, 1)
    assert info.value.scope == "key"
    assert "key 'key1' of tenant 'acme'" in info.value.message

    other_key = make_principal(
        requests_per_minute=100, key_id="key2", model_limits={"big": Limits(tokens_per_minute=1000)}
    )
    await admission.admit(other_key, "big", 400, 400)
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(other_key, "big", 400, 400)
    assert (info.value.scope, info.value.limit) == ("model", "tokens_per_minute")
    assert "model 'big'" in info.value.message
    await admission.admit(other_key, "small", 400, 400)  # other models are not limited


async def test_a_rejected_request_consumes_nothing(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(
        requests_per_minute=100,
        tokens_per_minute=1000,
        max_concurrency=5,
        monthly_token_budget=10_000,
        key_limits=Limits(requests_per_minute=50, max_concurrency=3),
    )
    await admission.admit(who, "m", 10, 890)  # leaves 100 tokens
    before = await snapshot(redis_client)
    with pytest.raises(LimitExceededError):
        await admission.admit(who, "m", 10, 200)
    assert await snapshot(redis_client) == before


async def test_request_larger_than_the_token_limit_is_refused_without_retry(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(tokens_per_minute=1000)
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(who, "m", 900, 200)
    assert info.value.headers["x-should-retry"] == "false"
    assert info.value.scope == "request"
    assert await redis_client.keys("*") == []


async def test_default_reservation_is_capped_to_fit_the_token_limit(
    admission: Admission, make_principal: MakePrincipal
) -> None:
    roomy = make_principal(tokens_per_minute=10_000, max_tokens_default=4096)
    assert (await admission.admit(roomy, "m", 100, None)).reserved_tokens == 100 + 4096
    small = make_principal("tiny", tokens_per_minute=1000, max_tokens_default=4096)
    # 4096 would never fit a 1000 tokens/min limit: reserve what is left after the prompt
    assert (await admission.admit(small, "m", 300, None)).reserved_tokens == 1000
    unlimited = make_principal("free", max_tokens_default=4096)
    assert (await admission.admit(unlimited, "m", 300, None)).headers == {}


async def test_short_completion_is_refunded_and_long_usage_charged(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(tokens_per_minute=100_000)
    key = "portico:rl:{acme}:t:tpm"
    ticket = await admission.admit(who, "m", 1000, 9000)
    assert 90_000 <= await tokens_in(redis_client, key) < 90_100
    await admission.settle(ticket, 1000, 50)  # 8,950 reserved tokens were not used
    assert 98_950 <= await tokens_in(redis_client, key) < 99_100

    ticket = await admission.admit(who, "m", 10, 10)
    await admission.settle(ticket, 10, 5000)  # upstream produced more than reserved
    assert 93_940 <= await tokens_in(redis_client, key) < 94_200  # 98,950 - 5,010


async def test_monthly_budget_is_charged_at_settle_and_then_refuses(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(monthly_token_budget=1000)
    ticket = await admission.admit(who, "m", 600, 100)
    await admission.settle(ticket, 600, 500)
    budget_key = f"portico:budget:{{acme}}:t:{utc_month(__import__('time').time())}"
    assert await redis_client.get(budget_key) == b"1100"
    assert await redis_client.ttl(budget_key) > 60 * 86400 - 10
    with pytest.raises(InsufficientQuotaError) as info:
        await admission.admit(who, "m", 1, 1)
    err = info.value
    assert isinstance(err, RateLimitError) and err.status_code == 429
    assert err.to_dict()["error"]["type"] == "insufficient_quota"
    assert err.code == "insufficient_quota"
    assert err.headers["x-should-retry"] == "false"
    assert "monthly_token_budget" in err.message


async def test_concurrency_slot_is_released_when_the_client_disconnects(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(max_concurrency=1)
    started = asyncio.Event()

    async def handle_request() -> None:
        ticket = await admission.admit(who, "m", 5, 5)
        try:
            started.set()
            await asyncio.Event().wait()  # streaming, until the client goes away
        finally:
            await admission.release(ticket)

    task = asyncio.create_task(handle_request())
    await started.wait()
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(who, "m", 5, 5)
    assert info.value.limit == "max_concurrency"
    assert info.value.headers["retry-after"] == "1"
    task.cancel()  # what Starlette does on a client disconnect
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await redis_client.zcard("portico:rl:{acme}:t:conc") == 0
    await admission.release(await admission.admit(who, "m", 5, 5))


async def test_concurrency_slot_is_released_when_the_upstream_crashes(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(max_concurrency=2, tokens_per_minute=10_000)

    async def handle_request() -> None:
        ticket = await admission.admit(who, "m", 5, 100)
        try:
            raise ConnectionResetError("upstream closed the connection")
        finally:
            await admission.release(ticket)

    for _ in range(5):
        with pytest.raises(ConnectionResetError):
            await handle_request()
    assert await redis_client.zcard("portico:rl:{acme}:t:conc") == 0
    # release without settle keeps the reservation charged (usage unknown): 5 x 105 tokens
    assert 9_475 <= await tokens_in(redis_client, "portico:rl:{acme}:t:tpm") < 9_500


async def test_settle_and_release_are_idempotent(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(max_concurrency=3, monthly_token_budget=10**6)
    ticket = await admission.admit(who, "m", 10, 10)
    await admission.settle(ticket, 10, 10)
    await admission.settle(ticket, 10, 10)
    await admission.release(ticket)
    assert ticket.done
    month = utc_month(__import__("time").time())
    assert await redis_client.get(f"portico:budget:{{acme}}:t:{month}") == b"20"
    assert await redis_client.zcard("portico:rl:{acme}:t:conc") == 0


async def test_idle_keys_expire_when_the_bucket_would_be_full(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=100, tokens_per_minute=60_000)
    await admission.admit(who, "m", 100, 900)
    rpm_ttl = await redis_client.pttl("portico:rl:{acme}:t:rpm")
    tpm_ttl = await redis_client.pttl("portico:rl:{acme}:t:tpm")
    assert 0 < rpm_ttl <= 601  # one request at 100/min refills in 600 ms
    assert 0 < tpm_ttl <= 1001  # 1000 tokens at 1000/s
    assert await redis_client.pttl("portico:rl:{acme}:t:conc") == -2  # no concurrency limit


async def test_script_is_reloaded_after_script_flush(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=10)
    await admission.admit(who, "m", 1, 1)
    await redis_client.script_flush()
    ticket = await admission.admit(who, "m", 1, 1)
    assert ticket.headers["x-ratelimit-remaining-requests"] == "8"


async def test_storm_of_1000_requests_admits_at_most_the_limit_plus_refill(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=100)
    start_s, start_us = await redis_client.time()

    async def attempt() -> bool:
        try:
            await admission.release(await admission.admit(who, "m", 1, 1))
        except LimitExceededError:
            return False
        return True

    results = await asyncio.gather(*(attempt() for _ in range(1000)))
    end_s, end_us = await redis_client.time()
    elapsed_s = (end_s - start_s) + (end_us - start_us) / 1e6
    admitted = sum(results)
    assert admission.redis_up  # every decision was Redis's
    assert 100 <= admitted <= 100 + int(100 * elapsed_s / 60) + 1


async def test_production_path_takes_time_from_redis(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(requests_per_minute=10)
    before_s, before_us = await redis_client.time()
    await admission.admit(who, "m", 1, 1)
    after_s, after_us = await redis_client.time()
    stamp = int(await redis_client.hget("portico:rl:{acme}:t:rpm", "s"))
    assert before_s * 1_000_000 + before_us <= stamp <= after_s * 1_000_000 + after_us


async def _assert_busy_while_pool_is_held(
    client: Redis, make_principal: MakePrincipal
) -> tuple[Admission, Principal]:
    """With the client's only connection held elsewhere, an admission is a 503
    ``rate_limiter_busy`` and the Redis limiter stays in charge; returns the Admission and the
    principal it refused (the connection is released again)."""
    admission = Admission(client, AdmissionSettings(), registry=CollectorRegistry())
    who = make_principal(requests_per_minute=10)
    held = await client.connection_pool.get_connection()  # every connection is in use
    try:
        with pytest.raises(ServiceUnavailableError) as info:
            await admission.admit(who, "m", 1, 1)
        assert info.value.code == "rate_limiter_busy"
        assert admission.redis_up  # no switch to the fallback: that would over-admit
    finally:
        await client.connection_pool.release(held)
    return admission, who


async def test_pool_exhaustion_is_503_not_an_outage(
    redis_url: str, make_principal: MakePrincipal
) -> None:
    # A non-blocking pool of one connection, held by someone else: the pool is exhausted.
    client = Redis.from_url(redis_url, max_connections=1)
    try:
        await _assert_busy_while_pool_is_held(client, make_principal)
    finally:
        await client.aclose()


async def test_a_zero_limit_refuses_without_touching_redis(
    admission: Admission, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    who = make_principal(
        requests_per_minute=100, model_limits={"gpu-big": Limits(max_concurrency=0)}
    )
    with pytest.raises(LimitExceededError) as info:
        await admission.admit(who, "gpu-big", 1, 1)
    assert (info.value.scope, info.value.limit) == ("model", "max_concurrency")
    assert info.value.headers["x-should-retry"] == "false"
    assert await redis_client.keys("*") == []


BUSY_REDIS_LUA = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1])
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


async def test_no_free_connection_in_time_is_503_busy_not_an_outage(
    redis_url: str, make_principal: MakePrincipal
) -> None:
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=0.1)
    client = Redis.from_pool(pool)
    admission, who = await _assert_busy_while_pool_is_held(client, make_principal)
    await admission.release(await admission.admit(who, "m", 1, 1))
    await client.aclose()


async def test_redis_that_stops_answering_is_found_down_by_a_probe(
    redis_url: str, redis_client: Redis, make_principal: MakePrincipal
) -> None:
    # socket_timeout fires on an open connection: Redis is not answering (or we are slow)
    slow_client = Redis.from_url(redis_url, socket_timeout=0.5)
    settings = AdmissionSettings(redis_timeout_seconds=0.5)
    admission = Admission(slow_client, settings, registry=CollectorRegistry())
    who = make_principal(requests_per_minute=10)
    await redis_client.script_load(LUA_SOURCE)
    for _ in range(20):  # open the slow client's connection while Redis is idle
        with contextlib.suppress(redis.exceptions.TimeoutError):
            await slow_client.ping()
            break
    refused: ServiceUnavailableError | None = None
    # On a loaded machine the admission may reach Redis before the script does (and be
    # admitted): then try again. Once the 4 s script runs, Redis answers nobody.
    for _ in range(10):
        blocker = asyncio.create_task(redis_client.eval(BUSY_REDIS_LUA, 0, 4_000_000))
        await asyncio.sleep(0.05)
        try:
            await admission.admit(who, "m", 1, 1)
        except ServiceUnavailableError as exc:  # cannot tell yet: 503, and a PING
            refused = exc
            break
        await blocker
    assert refused is not None
    assert refused.code == "rate_limiter_busy"
    for _ in range(300):
        if not admission.redis_up:
            break
        await asyncio.sleep(0.01)
    assert not admission.redis_up  # the PING timed out too: Redis is down
    ticket = await admission.admit(who, "m", 1, 1)  # decided by the local fallback
    assert ticket.headers["x-ratelimit-remaining-requests"] == "9"  # a fresh local bucket
    await blocker
    await admission.aclose()
    await slow_client.aclose()
