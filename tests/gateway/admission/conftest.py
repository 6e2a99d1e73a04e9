"""Fixtures for the admission tests: a Redis client with short timeouts, a fake clock, and the
two limiter implementations the conformance suite runs against."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.limiter import Limiter, LocalLimiter, RedisLimiter
from gateway.principal import Limits, Principal

REDIS_TIMEOUT_S = 0.5


class FakeClock:
    """Real time plus an offset that tests push forward: time jumps on demand, never runs slower
    than real time. Redis expires keys in real time, so a clock that lagged real time could see
    a bucket vanish (full) before its own time said it had refilled."""

    def __init__(self) -> None:
        self.offset_us = 0

    def __call__(self) -> int:
        return time.time_ns() // 1000 + self.offset_us

    def advance(self, seconds: float) -> None:
        self.offset_us += int(seconds * 1_000_000)


def make_redis(url: str) -> Redis:
    """A client configured as the gateway should configure its own: short socket timeouts (a
    dead Redis fails fast) and a blocking pool (a burst queues for a connection instead of
    failing with MaxConnectionsError)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=32,
        timeout=None,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
    )
    return Redis.from_pool(pool)


@pytest.fixture
def redis_client_factory() -> Callable[[str], Redis]:
    return make_redis


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = make_redis(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["redis", "local"])
async def limiter(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Limiter]:
    """Each implementation of the Limiter interface, on the fake clock."""
    if request.param == "local":
        yield LocalLimiter(clock=clock)
        return
    client = make_redis(request.getfixturevalue("redis_url"))
    yield RedisLimiter(client, clock=clock)
    await client.aclose()


@pytest.fixture
def make_principal() -> Callable[..., Principal]:
    return build_principal


def build_principal(
    tenant: str = "acme",
    *,
    key_id: str | None = "key1",
    key_limits: Limits | None = None,
    model_limits: dict[str, Limits] | None = None,
    **limits: int | None,
) -> Principal:
    return Principal(
        tenant_id=tenant,
        plan="test",
        limits=Limits(**limits),
        key_id=key_id,
        key_limits=key_limits,
        model_limits=model_limits or {},
    )
