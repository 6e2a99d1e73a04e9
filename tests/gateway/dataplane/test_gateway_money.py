"""Money end to end: ``portico serve`` in front of a real tiny engine and a fake remote
provider (load/fake_upstream.py), with prices from the config and from the admin API.

Proves: the spend the gateway records is the price formula applied to the engine's own usage
(cached prompt tokens at the cached price), streamed or not, in the usage API, the export and
Prometheus; a remote tier is priced and budgeted the same way; a spent key budget refuses that
key before the request (429 ``budget_exceeded``, nothing recorded or forwarded) while another
key of the tenant goes on; a tenant's daily budget refuses every key.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, tiny_engine, wait_until

A = {"authorization": f"Bearer {ADMIN_KEY}"}
# USD per 1M tokens: whole micro-dollars per token, so the expected sums are exact integers
TINY = {"input": 1000, "cached_input": 100, "output": 3000}
REMOTE = {"input": 500, "output": 1500}
ROUTING = {"tiers": [{"name": "small", "model": "tiny", "max_score": 1.0}, {"name": "large",
           "model": "remote"}]}  # fmt: skip


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> Iterator[RedisServer]:
    """A Redis of this module's own: other tests empty the session's between tests."""
    server = RedisServer(module_tmp / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(
    module_tmp: Path, store: RedisServer, tiny_llama_dir: Path, fake_remote: str
) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": store.url},
            "engines": [tiny_engine(tiny_llama_dir, "tiny")],
            "remotes": [
                {
                    "name": "remote",
                    "model": "openai/remote",
                    "api_base": fake_remote + "/v1",
                    "api_key_env": "HOME",
                }
            ],
            "pricing": {"tiny": TINY, "remote": {"input": 1, "output": 1}},
        },
        ROUTING,
    )
    gw.start(timeout=600)
    # the admin API's price overrides the config's
    r = httpx.put(gw.base_url + "/admin/v1/prices/remote", json=REMOTE, headers=A, timeout=10)
    assert r.status_code == 200 and r.json()["source"] == "admin", r.text
    yield gw
    assert gw.terminate() == 0, gw.log()


def admin(gw: GatewayProcess) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, headers=A, timeout=30)


def new_key(gw: GatewayProcess, tenant_id: str, **limits: Any) -> tuple[str, str]:
    with admin(gw) as c:
        r = c.post(f"/admin/v1/tenants/{tenant_id}/keys", json={"limits": limits or None})
        r.raise_for_status()
        return r.json()["id"], r.json()["key"]


def oa(gw: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def usage_of(gw: GatewayProcess, tenant_id: str) -> dict[str, Any]:
    with admin(gw) as c:
        r = c.get(f"/admin/v1/tenants/{tenant_id}/usage")
        r.raise_for_status()
        return dict(r.json())


def counted(gw: GatewayProcess, tenant_id: str, requests: int) -> dict[str, Any]:
    """The tenant's usage once ``requests`` requests are recorded (written in batches)."""
    assert wait_until(lambda: usage_of(gw, tenant_id)["totals"]["requests"] >= requests, 30)
    return usage_of(gw, tenant_id)


def spend(usage: Any, price: dict[str, float]) -> int:
    """The price formula in micro-dollars (the test prices are whole micro-dollars a token)."""
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return int(
        (usage.prompt_tokens - cached) * price["input"]
        + cached * price.get("cached_input", price["input"])
        + usage.completion_tokens * price["output"]
    )


def spend_key(store: RedisServer, tenant_id: str, scope: str, period: str) -> int:
    client = redis.Redis.from_url(store.url)
    return int(client.get(f"portico:spend:{{{tenant_id}}}:{scope}:{period}") or 0)


def test_spend_is_the_price_formula_on_the_engines_usage(gateway: GatewayProcess) -> None:
    tenant_id, key = gateway.create_tenant("standard")
    client = oa(gateway, key)
    # long enough for several full KV blocks: the repeat reads them from the prefix cache
    messages = [{"role": "user", "content": "the quick brown fox jumps " * 20}]
    usages = [
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0
        ).usage
        for _ in range(2)
    ]
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append([c for c in stream if c.usage is not None][-1].usage)
    assert all(u is not None for u in usages)
    assert usages[1].prompt_tokens_details.cached_tokens > 0  # the engine's own report
    expected = sum(spend(u, TINY) for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    totals = counted(gateway, tenant_id, 3)["totals"]
    assert totals["spend_micro_usd"] == expected
    assert totals["cached_tokens"] == cached
    assert totals["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert totals["completion_tokens"] == sum(u.completion_tokens for u in usages)
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    values = [
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "portico_spend_usd_total"
        and sample.labels == {"tenant": tenant_id, "model": "tiny"}
    ]
    assert values == [pytest.approx(expected / 1e6, rel=1e-9)]


def test_remote_tier_is_priced_and_a_spent_key_budget_refuses_only_that_key(
    gateway: GatewayProcess, store: RedisServer
) -> None:
    tenant_id, _ = gateway.create_tenant("standard")
    # one request of the fake's (~10 prompt tokens, 3 completion tokens) costs ~0.01 USD; the
    # gateway's estimate of the prompt (a remote model: characters / 4) fits in 0.004 USD, so
    # the first request is admitted and spends the budget
    capped_id, capped = new_key(gateway, tenant_id, budget_usd=0.004, budget_period="daily")
    free_id, free = new_key(gateway, tenant_id)
    messages = [{"role": "user", "content": "hi"}]
    first = oa(gateway, capped).chat.completions.create(
        model="remote", messages=messages, max_tokens=3
    )
    expected = spend(first.usage, REMOTE)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert wait_until(lambda: spend_key(store, tenant_id, f"k:{capped_id}", f"d:{day}") > 0, 30)
    assert spend_key(store, tenant_id, f"k:{capped_id}", f"d:{day}") == expected
    assert counted(gateway, tenant_id, 1)["keys"][capped_id]["spend_micro_usd"] == expected

    with pytest.raises(openai.RateLimitError) as info:
        oa(gateway, capped).chat.completions.create(model="remote", messages=messages)
    err = info.value.body
    assert isinstance(err, dict)
    assert err["code"] == "budget_exceeded" and err["type"] == "insufficient_quota"
    assert f"daily_budget_usd of key '{capped_id}'" in err["message"]
    assert info.value.response.headers["x-should-retry"] == "false"
    # the key's other model is refused too: the budget is the key's, not the model's
    with pytest.raises(openai.RateLimitError):
        oa(gateway, capped).chat.completions.create(model="tiny", messages=messages)

    second = oa(gateway, free).chat.completions.create(
        model="remote", messages=messages, max_tokens=3
    )
    usage = counted(gateway, tenant_id, 2)
    assert usage["totals"]["requests"] == 2  # the refused requests reached no upstream
    assert usage["keys"][capped_id]["requests"] == 1
    assert usage["keys"][free_id]["spend_micro_usd"] == spend(second.usage, REMOTE)
    assert spend_key(store, tenant_id, f"k:{capped_id}", f"d:{day}") == expected

    # the export says the same, one row per key and model
    with admin(gateway) as c:
        r = c.get(
            "/admin/v1/usage/export",
            params={"start": day, "end": day, "format": "csv", "tenant_id": tenant_id},
        )
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert [(x["key_id"], x["model"], int(x["spend_micro_usd"])) for x in rows] == sorted(
        [(capped_id, "remote", expected), (free_id, "remote", spend(second.usage, REMOTE))]
    )


def test_a_spent_tenant_budget_refuses_every_key(gateway: GatewayProcess) -> None:
    tenant_id, key = gateway.create_tenant("standard")
    _, other = new_key(gateway, tenant_id)
    messages = [{"role": "user", "content": "hi"}]
    oa(gateway, key).chat.completions.create(model="remote", messages=messages, max_tokens=3)
    counted(gateway, tenant_id, 1)
    with admin(gateway) as c:
        r = c.patch(
            f"/admin/v1/tenants/{tenant_id}",
            json={"overrides": {"budget_usd": 0, "budget_period": "daily"}},
        )
        assert r.status_code == 200, r.text
    for secret in (key, other):
        with pytest.raises(openai.RateLimitError) as info:
            oa(gateway, secret).chat.completions.create(model="tiny", messages=messages)
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "budget_exceeded"
        assert f"daily_budget_usd of tenant '{tenant_id}'" in body["message"]
    assert usage_of(gateway, tenant_id)["totals"]["requests"] == 1


def test_a_stream_stops_when_the_money_runs_out(gateway: GatewayProcess) -> None:
    """Admission caps max_tokens at what the key's budget still pays for after the prompt; the
    engine stops there by itself and the stream says which budget stopped it."""
    tenant_id, probe = gateway.create_tenant("standard")
    messages = [{"role": "user", "content": "count to one hundred"}]
    first = oa(gateway, probe).chat.completions.create(
        model="tiny", messages=messages, max_tokens=1
    )
    assert first.usage is not None
    prompt = first.usage.prompt_tokens
    # the prompt at 1000 micro-dollars a token, three completion tokens at 3000, and 500 over
    budget = (prompt * 1000 + 3 * 3000 + 500) / 1e6
    key_id, key = new_key(gateway, tenant_id, budget_usd=budget)
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    events = []
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-portico-budget-max-tokens"] == "3"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert usage["completion_tokens"] == 3
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", [])]
    assert "length" in finishes
    error = chunks[-1]["error"]
    assert error["code"] == "budget_exceeded"
    assert f"monthly_budget_usd of key '{key_id}'" in error["message"]
