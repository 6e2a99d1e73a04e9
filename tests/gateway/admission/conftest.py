"""Fixtures for the admission tests: a Redis client with short timeouts, a fake clock, and the
limiter implementations the conformance suite runs against (Redis through redis-py and through
the pipelined connection, Redis Cluster of three masters, local)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.admission.limiter import Limiter, LocalLimiter, RedisLimiter
from gateway.admission.redis_pipe import RedisPipe
from gateway.identity.principal import Limits, Principal
from gateway.store import RedisTopology, StoreSettings, connect

# A stopped Redis is found at once whatever these are (its socket is gone); they only bound
# how long a test can hang, and must not fire on a merely loaded machine.
CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 5.0


class FakeClock:
    """A clock that moves only when a test moves it, set a day ahead of real time.

    Ahead, because Redis expires keys by its own real clock: the limiter sets expiry on the
    script's clock (PEXPIREAT), so with this clock no key vanishes while a test runs, and every
    number a test sees is exact, never shifted by how long the machine took.
    """

    def __init__(self) -> None:
        self.now_us = time.time_ns() // 1000 + 86_400_000_000

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float) -> None:
        self.now_us += int(seconds * 1_000_000)


def make_redis(url: str) -> Redis:
    """A client configured as the gateway should configure its own: short socket timeouts (a
    dead Redis fails fast) and a blocking pool (a burst queues for a connection instead of
    failing with MaxConnectionsError)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=32,
        timeout=None,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
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


@pytest.fixture
def clock_factory() -> Callable[[], FakeClock]:
    """For tests that need a fresh clock per hypothesis example."""
    return FakeClock


@pytest.fixture(params=["redis", "redis-pipe", "redis-cluster", "local"])
async def limiter(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Limiter]:
    """Each implementation of the Limiter interface, on the fake clock (the Redis one through
    redis-py, through the gateway's pipelined connection, and on a Redis Cluster through the
    client the gateway opens for a ``redis+cluster://`` URL)."""
    if request.param == "local":
        yield LocalLimiter(clock=clock)
        return
    if request.param == "redis-cluster":
        url = request.getfixturevalue("redis_cluster_url")
        cluster = connect(
            RedisTopology.parse(url),
            StoreSettings(max_connections=32, socket_timeout_s=SOCKET_TIMEOUT_S),
        )
        yield RedisLimiter(cluster, clock=clock)
        await cluster.aclose()
        return
    client = make_redis(request.getfixturevalue("redis_url"))
    pipe = RedisPipe.from_client(client) if request.param == "redis-pipe" else None
    yield RedisLimiter(client, clock=clock, pipe=pipe)
    if pipe is not None:
        await pipe.aclose()
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
