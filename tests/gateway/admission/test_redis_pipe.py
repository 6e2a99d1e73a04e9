"""The pipelined Redis connection admission uses: many commands in flight on one connection,
each answered with its own reply, and failures that keep redis-py's exception types (so
admission still tells "down" from "slow")."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis.exceptions
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.admission.admission import Admission, AdmissionSettings
from gateway.admission.failover import failure_kind
from gateway.admission.limiter import BucketSet, RedisLimiter
from gateway.admission.redis_pipe import RedisPipe, encode_command, script_sha
from gateway.identity.principal import Principal
from tests.conftest import redis_server_binary

BUSY_REDIS_LUA = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1])
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


def test_commands_are_encoded_as_resp() -> None:
    assert encode_command(("SET", "k", 12, b"\x00v")) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$2\r\n\x00v\r\n"
    )
    with pytest.raises(TypeError):
        encode_command(("SET", "k", None))


async def test_concurrent_commands_share_one_connection_and_get_their_own_replies(
    redis_client: Redis,
) -> None:
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    try:
        ids, counts = await asyncio.gather(
            asyncio.gather(*(pipe.execute("CLIENT", "ID") for _ in range(50))),
            asyncio.gather(*(pipe.execute("INCR", "n") for _ in range(200))),
        )
        assert len(set(ids)) == 1  # one connection for all of them
        assert sorted(counts) == list(range(1, 201))  # each call got its own reply
        assert int(await redis_client.get("n")) == 200
    finally:
        await pipe.aclose()


async def test_an_error_reply_fails_only_its_own_command(redis_client: Redis) -> None:
    await redis_client.hset("h", "f", "1")
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    try:
        good1, bad, good2 = await asyncio.gather(
            pipe.execute("SET", "a", "1"),
            pipe.execute("INCR", "h"),
            pipe.execute("GET", "a"),
            return_exceptions=True,
        )
        assert good1 == b"OK" and good2 == b"1"
        assert isinstance(bad, redis.exceptions.ResponseError)
        assert "WRONGTYPE" in str(bad)
        assert await pipe.execute("GET", "a") == b"1"  # the connection is still in step
    finally:
        await pipe.aclose()


async def test_a_cancelled_caller_does_not_shift_the_replies(redis_client: Redis) -> None:
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    try:
        await pipe.execute("SET", "x", "first")
        waiting = asyncio.ensure_future(pipe.execute("GET", "x"))
        await asyncio.sleep(0)  # queued, maybe written
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await pipe.execute("SET", "x", "second")
        assert await pipe.execute("GET", "x") == b"second"
    finally:
        await pipe.aclose()


async def test_a_script_redis_does_not_know_is_loaded_with_eval(redis_client: Redis) -> None:
    await redis_client.script_flush()
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    source = "return tonumber(ARGV[1]) + 1"
    try:
        assert await pipe.evalsha(script_sha(source), source, [], [41]) == 42
        assert await redis_client.script_exists(script_sha(source)) == [True]
        assert await pipe.evalsha(script_sha(source), source, [], [1]) == 2
    finally:
        await pipe.aclose()


async def test_the_database_of_the_url_is_selected(redis_url: str) -> None:
    client = Redis.from_url(redis_url + "?db=3")
    pipe = RedisPipe.from_client(client)
    assert pipe is not None
    try:
        await pipe.execute("SET", "in-db-3", "yes")
        assert await client.get("in-db-3") == b"yes"
        assert await Redis.from_url(redis_url).get("in-db-3") is None  # not in db 0
    finally:
        await pipe.aclose()
        await client.aclose()


async def test_a_tls_client_gets_no_pipe() -> None:
    assert RedisPipe.from_client(Redis.from_url("rediss://localhost:6380")) is None


async def test_a_stopped_redis_is_down_and_a_restarted_one_is_used_again(private_redis) -> None:  # type: ignore[no-untyped-def]
    pipe = RedisPipe(path=str(private_redis.socket), timeout_s=2.0, connect_timeout_s=2.0)
    try:
        assert await pipe.execute("PING") == b"PONG"
        private_redis.stop()
        with pytest.raises(redis.exceptions.ConnectionError) as info:
            await pipe.execute("PING")
        assert failure_kind(info.value) == "down"
        with pytest.raises(redis.exceptions.ConnectionError):  # connecting fails too
            await pipe.execute("PING")
        private_redis.start()
        assert await pipe.execute("PING") == b"PONG"  # reconnected
    finally:
        await pipe.aclose()


async def test_no_reply_in_time_is_a_timeout_and_the_connection_recovers(
    redis_client: Redis,
) -> None:
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    slow = RedisPipe(path=pipe._path, timeout_s=0.3, connect_timeout_s=2.0)
    try:
        assert await slow.execute("PING") == b"PONG"
        error: Exception | None = None
        # On a loaded machine the PING may reach Redis before the script does (and get its
        # PONG): then try again. Once the script runs, Redis answers nobody for 1.5 s.
        for _ in range(10):
            blocker = asyncio.ensure_future(redis_client.eval(BUSY_REDIS_LUA, 0, 1_500_000))
            await asyncio.sleep(0.1)
            try:
                await slow.execute("PING")
            except redis.exceptions.TimeoutError as exc:
                error = exc
            await blocker
            if error is not None:
                break
        assert isinstance(error, redis.exceptions.TimeoutError)
        assert failure_kind(error) == "slow"
        assert await slow.execute("PING") == b"PONG"
    finally:
        await slow.aclose()
        await pipe.aclose()


async def test_concurrent_admissions_and_settlements_keep_slots_exact(
    redis_client: Redis,
) -> None:
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    limiter = RedisLimiter(redis_client, pipe=pipe)
    buckets = BucketSet(
        rate_keys=("rl:t:rpm",), rate_limits=(1000,), slot_keys=("rl:t:conc",), slot_limits=(50,)
    )
    try:
        decisions = await asyncio.gather(
            *(limiter.acquire(buckets, [1], f"slot-{i}", 60_000_000) for i in range(80))
        )
        allowed = [i for i, d in enumerate(decisions) if d.allowed]
        assert len(allowed) == 50  # one pipelined batch, and still never past the limit
        assert await redis_client.zcard("rl:t:conc") == 50
        assert int(float(await redis_client.hget("rl:t:rpm", "t"))) == 1000 - 50
        await asyncio.gather(*(limiter.settle(buckets, [0], [], f"slot-{i}") for i in allowed))
        assert await redis_client.zcard("rl:t:conc") == 0  # every slot freed
    finally:
        await pipe.aclose()


async def test_admission_on_a_pipe_falls_back_while_redis_is_down(
    private_redis,
    make_principal: Callable[..., Principal],  # type: ignore[no-untyped-def]
) -> None:
    client = Redis.from_url(private_redis.url, socket_timeout=2.0, socket_connect_timeout=2.0)
    pipe = RedisPipe.from_client(client)
    assert pipe is not None
    settings = AdmissionSettings(redis_down_policy="local", probe_interval_seconds=0.05)
    admission = Admission(
        client, settings, registry=CollectorRegistry(), limiter=RedisLimiter(client, pipe=pipe)
    )
    who = make_principal(requests_per_minute=10, max_concurrency=5)
    try:
        ticket = await admission.admit(who, "m", 1, 1)
        await admission.release(ticket)
        assert await client.zcard("portico:rl:{acme}:t:conc") == 0  # released through the pipe
        private_redis.stop()
        ticket = await admission.admit(who, "m", 1, 1)  # decided by the local fallback
        assert not admission.redis_up
        assert ticket.headers["x-ratelimit-remaining-requests"] == "9"
        await admission.release(ticket)
    finally:
        await admission.aclose()
        await pipe.aclose()
        await client.aclose()


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[Path]:
    """A redis-server that wants the password ``s3cret``; yields its Unix socket."""
    sock = tmp_path / "auth.sock"
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            "s3cret",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    yield sock
    proc.terminate()
    proc.wait(10)


async def test_a_password_in_the_url_is_sent_before_any_command(password_redis: Path) -> None:
    good = Redis.from_url(f"unix://:s3cret@{password_redis}")
    pipe = RedisPipe.from_client(good)
    assert pipe is not None
    try:
        assert await pipe.execute("SET", "k", "v") == b"OK"
    finally:
        await pipe.aclose()
        await good.aclose()
    bad = RedisPipe(path=str(password_redis), password="wrong")
    try:
        with pytest.raises(redis.exceptions.ResponseError) as info:  # refused, and said so
            await bad.execute("GET", "k")
        assert "WRONGPASS" in str(info.value)
    finally:
        await bad.aclose()


async def test_many_commands_go_in_one_write_and_an_error_is_raised_after_all_ran(
    redis_client: Redis,
) -> None:
    await redis_client.hset("h", "f", "1")
    pipe = RedisPipe.from_client(redis_client)
    assert pipe is not None
    try:
        assert await pipe.execute_many([]) == []
        replies = await pipe.execute_many([("INCR", "n")] * 100 + [("GET", "n")])
        assert replies == list(range(1, 101)) + [b"100"]
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await pipe.execute_many(
                [("SET", "a", "1"), ("INCR", "h"), ("INCR", "h"), ("SET", "b", "2")]
            )
        assert await pipe.execute_many([("GET", "a"), ("GET", "b")]) == [b"1", b"2"]
    finally:
        await pipe.aclose()
