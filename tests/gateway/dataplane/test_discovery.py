"""gateway/fleet/discovery.py: engine replicas found by DNS, as on Kubernetes (a headless
Service's A records), against a REAL `portico engine` process on a loopback port that the
name ``localhost`` resolves to; and a real ``portico serve`` that finds it from its config and
answers a real ``openai`` client through it.

What DNS answers over time (records appearing and vanishing, a resolver hiccup) is scripted
with an injected resolver: this machine has no DNS server to change. Nothing listens on
127.0.0.2, which stands for an engine whose record exists but which is not ready.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import ConfigError, parse_config
from gateway.fleet.discovery import DiscoverySpec, DNSDiscovery, resolve_addresses
from gateway.fleet.pool import Pool, Replica
from gateway.relay.transport import LeanTransport
from tests.engine.server.engine_server_process import MODEL_NAME, EngineProcess
from tests.gateway.dataplane.harness import GatewayProcess


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, module_tmp: Path) -> Iterator[EngineProcess]:
    """A real engine on 127.0.0.1, without an API key (the gateway sends none)."""
    server = EngineProcess(tiny_llama_dir, module_tmp / "engine.log", api_key=None)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def make_replica(name: str, host: str, port: int) -> Replica:
    transport = LeanTransport(host=host, port=port)
    client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=30)
    return Replica(name, client, transport)


class ScriptedDNS:
    """A resolver whose next answers a test sets: a list of addresses, or None (failure)."""

    def __init__(self, answer: list[str] | None) -> None:
        self.answer = answer

    async def __call__(self, host: str, port: int) -> list[str] | None:
        return self.answer


async def test_localhost_resolves_to_the_loopback_address() -> None:
    assert "127.0.0.1" in (await resolve_addresses("localhost", 8001) or [])


async def test_replicas_follow_the_name_and_only_ready_ones_take_requests(
    engine: EngineProcess,
) -> None:
    pool = Pool("tiny", [])
    spec = DiscoverySpec(dns="localhost", port=engine.port, interval_s=1)
    discovery = DNSDiscovery(pool, spec, make_replica)
    try:
        await discovery.refresh()
        by_name = {r.name: r for r in pool.replicas}
        ready = by_name["tiny-127.0.0.1"]
        assert ready.up
        assert all(not r.up for r in pool.replicas if r is not ready)  # e.g. ::1: no listener
        picked = pool.pick(b"prefix")
        assert picked is ready
        answer = await picked.client.get("/v1/models")
        assert answer.json()["data"][0]["id"] == MODEL_NAME
    finally:
        await discovery.aclose()


async def test_vanished_records_drop_replicas_and_a_resolver_failure_keeps_them(
    engine: EngineProcess,
) -> None:
    pool = Pool("tiny", [])
    dns = ScriptedDNS(["127.0.0.1", "127.0.0.2"])
    spec = DiscoverySpec(dns="portico-engine-headless", port=engine.port, interval_s=1)
    discovery = DNSDiscovery(pool, spec, make_replica, resolve=dns)
    try:
        await discovery.refresh()
        assert {r.name: r.up for r in pool.replicas} == {
            "tiny-127.0.0.1": True,
            "tiny-127.0.0.2": False,  # a record, but nothing ready behind it
        }
        assert all(pool.pick(None) is pool.replicas[0] for _ in range(5))
        dns.answer = None  # the resolver failed: keep what we had
        await discovery.refresh()
        assert [r.name for r in pool.replicas] == ["tiny-127.0.0.1", "tiny-127.0.0.2"]
        dns.answer = ["127.0.0.2"]  # the ready pod went away
        gone = pool.replicas[0]
        await discovery.refresh()
        assert [r.name for r in pool.replicas] == ["tiny-127.0.0.2"]
        assert not gone.up and gone.client.is_closed
        assert pool.pick(None) is None  # nothing ready: the gateway answers 503
        dns.answer = []  # NXDOMAIN: a headless Service with no ready pod
        await discovery.refresh()
        assert pool.replicas == []
    finally:
        await discovery.aclose()


async def test_run_refreshes_every_interval(engine: EngineProcess) -> None:
    pool = Pool("tiny", [])
    dns = ScriptedDNS([])
    spec = DiscoverySpec(dns="portico-engine-headless", port=engine.port, interval_s=0.05)
    discovery = DNSDiscovery(pool, spec, make_replica, resolve=dns)
    task = asyncio.create_task(discovery.run())
    try:
        dns.answer = ["127.0.0.1"]
        for _ in range(200):
            if pool.replicas and pool.replicas[0].up:
                break
            await asyncio.sleep(0.05)
        assert [r.name for r in pool.replicas] == ["tiny-127.0.0.1"] and pool.replicas[0].up
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await discovery.aclose()


def test_discovery_config_is_validated() -> None:
    engines = [{"name": "tiny", "discovery": {"dns": "portico-engine-headless", "port": 8001}}]
    config = parse_config({"engines": engines})
    assert config.engines[0].discovery == DiscoverySpec(dns="portico-engine-headless", port=8001)
    with pytest.raises(ConfigError, match="engines.0.discovery.port"):
        parse_config({"engines": [{"discovery": {"dns": "x", "port": 0}}]})
    with pytest.raises(ConfigError, match="discovery"):
        parse_config({"engines": [{"command": ["x"], "discovery": {"dns": "x", "port": 1}}]})


@pytest.mark.slow
def test_gateway_serves_through_a_discovered_engine(
    engine: EngineProcess,
    module_tmp: Path,
    redis_server,
    tiny_llama_dir: Path,  # type: ignore[no-untyped-def]
) -> None:
    discovered = {
        "name": MODEL_NAME,
        "model": str(tiny_llama_dir),
        "discovery": {"dns": "localhost", "port": engine.port, "interval_s": 1},
    }
    gw = GatewayProcess(
        module_tmp / "gateway",
        {"redis": {"url": redis_server.url}, "engines": [discovered]},
        {"tiers": [{"name": "small", "model": MODEL_NAME}]},
    )
    try:
        gw.start()
        assert gw.health()["healthy_replicas"][MODEL_NAME] >= 1
        _, key = gw.create_tenant()
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert answer.choices[0].message.content is not None
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
        metrics = httpx.get(gw.base_url + "/metrics/engines", timeout=10).text
        assert f'engine="{MODEL_NAME}-127.0.0.1"' in metrics
    finally:
        assert gw.terminate() == 0, gw.log()
