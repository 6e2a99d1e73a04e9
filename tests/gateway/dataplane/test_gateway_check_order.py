"""A malformed request is a 400 whatever the quotas say, and costs nothing: ``portico serve`` in
front of a real tiny engine, a Redis of the module's own (its counters are read back), a tenant
whose money budget is spent and one with a money budget that runs low.

Proves (issue 45, items 1-3 and 6 through the real gateway): wrong types are named as wrong
types; bad sampling values, over-context ``max_tokens`` and malformed content parts are 400
before admission even with the budget spent, and change no counter; a 400 the engine finds
gives back the request it was charged; a money budget that cannot pay for the prompt refuses
with 429 ``budget_exceeded``, and one that runs low cuts the reply and says so in headers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, tiny_engine

A = {"authorization": f"Bearer {ADMIN_KEY}"}
PRICE = {"input": 100, "output": 2000}  # USD per 1M tokens: 100 / 2,000 micro-dollars a token
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(module_tmp / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, store: RedisServer, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": store.url},
            "engines": [tiny_engine(tiny_llama_dir, "tiny")],  # --max-model-len 1024
            "pricing": {"tiny": PRICE},
        },
        {},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def counters(store: RedisServer, tenant_id: str) -> dict[bytes, Any]:
    """Every rate bucket, slot set and budget of the tenant, as Redis holds them."""
    client = redis.Redis.from_url(store.url)
    try:
        state: dict[bytes, Any] = {}
        for pattern in ("portico:rl:", "portico:spend:", "portico:budget:"):
            for key in client.scan_iter(match=pattern + "{" + tenant_id + "}*"):
                kind = client.type(key)
                state[key] = (
                    client.hgetall(key)
                    if kind == b"hash"
                    else client.zrange(key, 0, -1)
                    if kind == b"zset"
                    else client.get(key)
                )
        return state
    finally:
        client.close()


def post(gw: GatewayProcess, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        gw.base_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    )


BAD_BODIES = [
    ({**CHAT, "temperature": "hot"}, "temperature", "Invalid type for 'temperature'"),
    ({**CHAT, "temperature": 7}, "temperature", "Invalid value for 'temperature'"),
    ({**CHAT, "max_tokens": 5000}, "max_tokens", "maximum context length is 1024 tokens"),
    ({**CHAT, "max_tokens": "3"}, "max_tokens", "Invalid type for 'max_tokens'"),
    ({**CHAT, "messages": "hello"}, "messages",
     "Invalid type for 'messages': expected an array of message objects, got a string."),
    ({**CHAT, "model": 123}, "model", "Invalid type for 'model': expected a string, got a number."),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", "Invalid type for 'messages[0].content[0].text'"),
    ({**CHAT, "messages": [{"role": "user"}]}, "messages[0].content",
     "Missing required parameter: 'messages[0].content'."),
]  # fmt: skip


def test_malformed_requests_are_400_before_a_spent_budget_and_change_nothing(
    gateway: GatewayProcess, store: RedisServer
) -> None:
    tenant_id, key = gateway.create_tenant(
        overrides={"requests_per_minute": 100, "budget_usd": 0}  # a budget of 0 is spent
    )
    refused = post(gateway, key, CHAT)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    before = counters(store, tenant_id)
    for body, param, message in BAD_BODIES:
        r = post(gateway, key, body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
    assert counters(store, tenant_id) == before  # no bucket, slot or budget moved
    # the completions and embeddings endpoints name wrong types the same way
    for path, body, param in [
        ("/v1/completions", {"model": "tiny", "prompt": {}}, "prompt"),
        ("/v1/embeddings", {"model": "tiny", "input": 5.5}, "input"),
    ]:
        r = httpx.post(
            gateway.base_url + path, json=body, headers={"authorization": f"Bearer {key}"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(f"Invalid type for '{param}': expected")


def test_a_400_from_the_engine_gives_back_the_request_it_was_charged(
    gateway: GatewayProcess,
) -> None:
    _, key = gateway.create_tenant(overrides={"requests_per_minute": 5})
    r = post(gateway, key, {**CHAT, "not_a_field": 1})  # only the engine knows every field
    assert r.status_code == 400 and r.json()["error"]["param"] == "not_a_field", r.text
    ok = post(gateway, key, CHAT)
    assert ok.status_code == 200, ok.text
    # the refused request was given back: this one is the first of five
    assert ok.headers["x-ratelimit-remaining-requests"] == "4"


def test_a_money_budget_refuses_a_prompt_it_cannot_pay_and_names_the_cut_it_makes(
    gateway: GatewayProcess, store: RedisServer
) -> None:
    # $0.01: 10,000 micro-dollars. "hi" in the chat template is ~30 tokens (3,000); a prompt of
    # 200 words is 20,000 and more: the budget cannot pay for it
    tenant_id, key = gateway.create_tenant(overrides={"budget_usd": 0.01})
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    long_prompt = [{"role": "user", "content": "hello " * 200}]
    before = counters(store, tenant_id)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=4)
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "budget_exceeded", error
    assert "costs at least" in error["message"] and "Shorten the prompt" in error["message"]
    assert counters(store, tenant_id) == before  # refused before anything was charged
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=50
    )
    reply = raw.parse()
    cap = int(raw.headers["x-portico-budget-max-tokens"])
    assert raw.headers["x-portico-budget-stop"] == f"monthly_budget_usd of tenant '{tenant_id}'"
    assert reply.usage is not None and reply.usage.completion_tokens <= cap < 50
    usage = reply.usage
    spent = usage.prompt_tokens * PRICE["input"] + usage.completion_tokens * PRICE["output"]
    assert spent <= 10_000  # the budget paid for no more than it held
