"""prefix_aware replica choice end to end: a real ``portico serve`` with two tiny engine
replicas. Prompts are cached on replica 1 directly (the way an earlier request would have left
them), and are chosen so that load-only routing (rendezvous on the prompt's first characters)
would send them to replica 0: a request that reports them cached was routed by the index."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.fleet.pool import _weight
from gateway.fleet.prefix_index import STALE_AFTER_S
from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine, wait_until

pytestmark = pytest.mark.slow

PLANS = {"default_plan": "team", "plans": {"team": {"share_prefix_cache": True}}}
TEAM_SALT = "shared:team"  # the engine salt of a plan that shares its cache (identity/tenants.py)
PREFIX_CHARS = 256


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    plans = module_tmp / "plans.yaml"
    plans.write_text(yaml.safe_dump(PLANS))
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url, "plans_file": str(plans)},
            "engines": [tiny_engine(tiny_llama_dir, "tiny", replicas=2)],
        },
        {
            "tiers": [{"name": "small", "model": "tiny"}],
            "replica_policy": "prefix_aware",
            "prefix_chars": PREFIX_CHARS,
        },
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def prompts_load_routing_sends_to_replica_0(n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        words = uuid.uuid4().hex
        prompt = " ".join(f"{words[i % 32]}{i} tale" for i in range(160))  # ~400 tokens
        key = prompt[:PREFIX_CHARS].encode()
        if _weight(key, b"tiny-0") > _weight(key, b"tiny-1"):
            out.append(prompt)
    return out


def cached_via_gateway(gw: GatewayProcess, key: str, prompt: str) -> int:
    r = httpx.post(
        gw.base_url + "/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_prompt_cached_on_one_replica_is_routed_to_it(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant("team")
    seeded = prompts_load_routing_sends_to_replica_0(30)
    replica_1 = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(gateway.workdir / "run" / "tiny-1.sock")),
        base_url="http://engine",
        timeout=120,
    )
    with replica_1:
        for prompt in seeded:
            r = replica_1.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": TEAM_SALT},
            )
            assert r.status_code == 200, r.text
    # A prompt nobody cached: no credit anywhere.
    assert cached_via_gateway(gateway, key, prompts_load_routing_sends_to_replica_0(1)[0]) == 0
    # Wait for the gateway's index to hold replica 1's blocks: each probe is a new seeded
    # prompt (a probe routed by load alone lands on replica 0 and misses).
    probes = iter(seeded[:15])
    assert wait_until(lambda: cached_via_gateway(gateway, key, next(probes)) > 0, timeout=60)
    # A gateway starved of CPU: paused past the index's staleness bound, it comes back to a
    # request before its next poll, on pooled connections the engines' keep-alive closed.
    # Freshness is judged by the replicas' answers, not by the time since our last poll, so
    # this must not send a seeded prompt by load (it did: the cause of this test's flakes).
    assert gateway.proc is not None
    os.kill(gateway.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(STALE_AFTER_S + 1)
    finally:
        os.kill(gateway.proc.pid, signal.SIGCONT)
    # From then on every seeded prompt goes to the replica holding it: load-only routing
    # would send each of them to replica 0 (0 hits).
    hits = [cached_via_gateway(gateway, key, p) >= 384 for p in seeded[15:]]
    assert all(hits), f"{sum(hits)} of 15 seeded prompts reached the replica that holds them"
