"""``redis.url`` for one server, a Redis Cluster or Sentinel, and the move of a store written
before hash tags to the tagged layout: URL parsing, real connections (a Sentinel with its
master and replica, started here), and the layout migration on one server and on a cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError

from gateway.identity.layout import LAYOUT_KEY, migrate_layout
from gateway.identity.plans import load_plans
from gateway.identity.records import KeyCreate, TenantCreate
from gateway.identity.tenants import TenantStore
from gateway.store import RedisTopology, StoreSettings, open_shared_redis
from tests.redis_topologies import LocalSentinel

SECRET = b"0123456789abcdef0123"


def test_cluster_and_sentinel_urls_parse() -> None:
    cluster = RedisTopology.parse("redis+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001")
    assert cluster.kind == "cluster"
    assert cluster.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert (cluster.username, cluster.password) == ("u", "p@ss")
    sentinel = RedisTopology.parse("redis+sentinel://:secret@s1:26379,[::1]:26380/portico")
    assert sentinel.kind == "sentinel"
    assert sentinel.nodes == (("s1", 26379), ("::1", 26380))
    assert (sentinel.username, sentinel.password, sentinel.service_name) == (
        None,
        "secret",
        "portico",
    )
    assert RedisTopology.parse("unix:///run/redis.sock").kind == "single"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://h1:7000/0", "no path"),
        ("redis+cluster://h1", "host:port"),
        ("redis+cluster://h1:7000?ssl=true", "no query"),
        ("redis+sentinel://s1:26379", "service_name"),
        ("redis+sentinel://s1:26379/portico/1", "service_name"),
        ("redis+sentinel://s1:notaport/portico", "bad port"),
        ("memcached://h:1", "must start with"),
    ],
)
def test_a_bad_url_is_refused_naming_the_problem(url: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        StoreSettings(url=url)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[LocalSentinel]:
    topology = LocalSentinel(tmp_path / "sentinel")
    topology.start()
    yield topology
    topology.stop()


async def test_the_gateway_store_works_through_sentinel(
    sentinel: LocalSentinel, tmp_path: Path
) -> None:
    shared = await open_shared_redis(StoreSettings(url=sentinel.url, data_dir=tmp_path), {})
    try:
        store = TenantStore(shared.client, SECRET, load_plans(None))
        await store.create_tenant(TenantCreate(id="acme", name="Acme"))
        _, secret = await store.create_key("acme", KeyCreate())
        found = await store.lookup_key(secret)
        assert found is not None and found[1] is not None and found[1].id == "acme"
        # The writes went to the master the Sentinel names, and reached its replica.
        with sentinel.master.client() as master:
            assert master.sismember("portico:tenants", "acme")
        assert shared.url == sentinel.url  # what the abuse limits (limits library) connect to
    finally:
        await shared.aclose()


def _write_layout_1(client: redis.Redis | redis.RedisCluster) -> None:
    """A store as a gateway without hash tags left it: a tenant, a key, usage with a TTL."""
    key = {
        "id": "key-1",
        "tenant_id": "acme",
        "display": "sk-...abcd",
        "digest": "d1",
        "created": 1,
        "tenant_uid": "u1",
    }
    tenant = {"id": "acme", "name": "Acme", "plan": "free", "uid": "u1"}
    client.set("portico:tenant:acme", json.dumps(tenant))
    client.sadd("portico:tenants", "acme")
    client.sadd("portico:tenant_keys:acme", "key-1")
    client.set("portico:key:key-1", json.dumps(key))
    client.hset("portico:keyhash:d1", mapping={"key_id": "key-1", "tenant_id": "acme"})
    client.hset("portico:usage:acme:2026-01-02", mapping={"requests": 7})
    client.expire("portico:usage:acme:2026-01-02", 3600)


@pytest.mark.parametrize("store", ["redis-server", "redis-cluster"])
async def test_a_store_written_before_hash_tags_moves_to_the_tagged_layout(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("redis_url" if store == "redis-server" else "redis_cluster_url")
    sync = (
        redis.RedisCluster.from_url(url.replace("redis+cluster://", "redis://").split(",")[0])
        if store == "redis-cluster"
        else redis.Redis.from_url(url)
    )
    _write_layout_1(sync)
    shared = await open_shared_redis(StoreSettings(url=url, data_dir=tmp_path), {})
    try:
        assert await migrate_layout(shared.client) == 4  # tenant, key set, key, usage
        assert await migrate_layout(shared.client) == 0  # done once; marked
        assert await shared.client.get(LAYOUT_KEY) == b"2"
        tenants = TenantStore(shared.client, SECRET, load_plans(None))
        assert [t.id for t in await tenants.list_tenants()] == ["acme"]
        assert [k.id for k in await tenants.list_keys("acme")] == ["key-1"]
        found = await tenants.lookup_digest("d1")
        assert found is not None and found[1] is not None and found[0].id == "key-1"
        ttl = await shared.client.ttl("portico:usage:{acme}:2026-01-02")
        assert 3000 < ttl <= 3600  # the TTL moved with the key
        assert await shared.client.hget("portico:usage:{acme}:2026-01-02", "requests") == b"7"
        for old in ("portico:tenant:acme", "portico:key:key-1", "portico:usage:acme:2026-01-02"):
            assert await shared.client.exists(old) == 0
    finally:
        await shared.aclose()
        sync.close()
