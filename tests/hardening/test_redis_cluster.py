"""The real gateway on a real Redis Cluster of three masters (``redis.url: redis+cluster://``):
tenants, keys, rate limits and usage through the admin API and the openai client, and a master
SIGKILLed under load for each outage policy, then started again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.dataplane.harness import (
    ADMIN_KEY,
    GatewayProcess,
    fake_engine_command,
    wait_until,
)
from tests.hardening.test_fault_scenarios import NUM_CLIENTS, Load, gauge
from tests.redis_topologies import LocalRedisCluster

MODEL = "fake"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def cluster_gateway(workdir: Path, cluster: LocalRedisCluster, **config: Any) -> GatewayProcess:
    gw = GatewayProcess(
        workdir,
        {
            "redis": {"url": cluster.url},
            "engines": [{"name": MODEL, "replicas": 1, "command": fake_engine_command()}],
            "admission": {
                "abuse": {k: "100000/minute" for k in ("unauthenticated", "failed_auth", "admin")},
                **config.pop("admission", {}),
            },
            **config,
        },
        {},
        {},
    )
    gw.start(timeout=120)
    return gw


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, redis_cluster: LocalRedisCluster
) -> Iterator[GatewayProcess]:
    redis_cluster.flushall()
    gw = cluster_gateway(tmp_path_factory.mktemp("cluster-gateway"), redis_cluster)
    yield gw
    gw.terminate()


def test_tenants_keys_limits_and_usage_work_on_a_cluster(
    gateway: GatewayProcess, redis_cluster: LocalRedisCluster
) -> None:
    admin = httpx.Client(base_url=gateway.base_url, headers=ADMIN, timeout=30)
    tenants = [f"team-{i}" for i in range(8)]
    for tenant in tenants:
        r = admin.post("/admin/v1/tenants", json={"id": tenant, "name": tenant, "plan": "standard"})
        assert r.status_code == 201, r.text
    # The tenants' records are spread over the masters: listing crosses slots and nodes.
    homes = {redis_cluster.node_for(f"portico:tenant:{{{t}}}").port for t in tenants}
    assert len(homes) >= 2
    listed = {t["id"] for t in admin.get("/admin/v1/tenants").json()["data"]}
    assert set(tenants) <= listed

    r = admin.patch("/admin/v1/tenants/team-0", json={"overrides": {"requests_per_minute": 3}})
    assert r.status_code == 200, r.text
    key = admin.post("/admin/v1/tenants/team-0/keys", json={"name": "ci"}).json()
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key["key"], max_retries=0)
    for _ in range(3):
        reply = client.chat.completions.create(**CHAT)
        assert reply.choices[0].message.content
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(**CHAT)
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "3"
    assert int(refused.value.response.headers["retry-after"]) >= 1

    def usage_counted() -> bool:
        totals = admin.get("/admin/v1/tenants/team-0/usage").json()["totals"]
        return bool(totals["requests"] == 3)

    assert wait_until(usage_counted, timeout=30)

    listed_keys = admin.get("/admin/v1/tenants/team-0/keys").json()["data"]
    assert [k["id"] for k in listed_keys] == [key["id"]]
    rotated = admin.post(f"/admin/v1/tenants/team-0/keys/{key['id']}/rotate", json={}).json()
    assert rotated["id"] != key["id"]
    assert admin.delete("/admin/v1/tenants/team-0").status_code == 204
    gone = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=rotated["key"], max_retries=0)

    # The gateway caches a resolved key for up to 2 s (auth.key_cache_ttl_seconds).
    def refused_after_delete() -> bool:
        try:
            gone.models.list()
        except openai.AuthenticationError:
            return True
        return False

    assert wait_until(refused_after_delete, timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["local", "open", "closed"])
def test_a_cluster_master_killed_under_load(tmp_path: Path, policy: str) -> None:
    cluster = LocalRedisCluster(tmp_path / "cluster")
    cluster.start()
    gw = None
    try:
        gw = cluster_gateway(
            tmp_path / "gw",
            cluster,
            admission={"redis_down_policy": policy, "probe_interval_seconds": 0.2},
            auth={"key_cache_ttl_seconds": 0},  # every request during the outage is judged
        )
        tenant_id, key = gw.create_tenant("standard")
        victim = cluster.node_for(f"portico:rl:{{{tenant_id}}}:t:rpm")
        with Load(gw.base_url, key, CHAT) as load:
            assert wait_until(lambda: load.served("before", 20), timeout=60)
            with victim.client() as c:
                c.save()  # the restarted master loads this (tenant, key)
            load.phase = "outage"
            victim.kill()
            assert wait_until(
                lambda: gauge(gw.base_url, "portico_admission_redis_up") == 0, timeout=60
            )
            ready = httpx.get(gw.base_url + "/ready", timeout=10)
            assert ready.json()["redis"] == "down"
            assert ready.status_code == (503 if policy == "closed" else 200)
            load.phase = "outage-seen"
            assert wait_until(lambda: load.served("outage-seen", 20), timeout=60)
            load.phase = "restart"
            victim.start()
            cluster.wait_ok()
            assert wait_until(
                lambda: gauge(gw.base_url, "portico_admission_redis_up") == 1, timeout=60
            )
            load.phase = "after"
            assert wait_until(lambda: load.served("after", 20), timeout=60)
        print(f"cluster, policy {policy}: what the clients received, by phase: {load.counts}")
        before, during, after = (load.counts[p] for p in ("before", "outage-seen", "after"))
        assert set(before) == {"200"}, before
        # Requests sent before the kill and still in flight when it came are counted under
        # "before->outage": policy closed keeps no outage copy of keys, so they may get 503
        # (checked with the other switches below); one per client at most.
        assert sum(load.counts.get("before->outage", {}).values()) <= NUM_CLIENTS
        if policy == "closed":
            assert set(during) <= {"503:rate_limiter_unavailable", "503:service_unavailable"}
        else:
            assert set(during) == {"200"}, during
        assert set(after) == {"200"}, after
        # Nor did the switches themselves (kill, restart) answer anything the policy does not:
        # no 500 and no dropped connection from a client that met the dead node's sockets.
        allowed = {"200"} | (
            {"503:service_unavailable", "503:rate_limiter_unavailable"}
            if policy == "closed"
            else set()
        )
        for phase, counts in load.counts.items():
            if phase in ("outage", "restart") or "->" in phase:
                assert set(counts) <= allowed, (phase, counts)
        with victim.client() as c:  # slots of requests in flight at the kill, at most
            pattern = f"portico:rl:{{{tenant_id}}}:*conc*"
            held = sum(int(c.zcard(k)) for k in c.scan_iter(match=pattern))
        assert held <= NUM_CLIENTS
    finally:
        if gw is not None:
            gw.terminate()
        cluster.stop()
