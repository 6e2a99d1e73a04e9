"""Every request is charged exactly the engine's own token counts, through the real gateway, a
real tiny engine and a real Redis: streamed, not streamed, n > 1, chat, completions, Responses,
embeddings, tools and structured outputs; a stream the client leaves midway is charged what was
generated; and a tenant's token budget stops a stream at the exact token it runs out.

What the gateway charged is read where admission keeps it: the tenant's monthly token budget
counter in Redis (``portico:budget:{tenant}:t:<month>``), written when the request settles.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine, wait_until

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}
PLANS = {"plans": {"metered": {"monthly_token_budget": 10**9, "max_tokens_default": 64}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "launch",
            "description": "Launch a rocket.",
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string"}},
                "required": ["target"],
            },
        },
    }
]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        },
    },
}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server: Any, tiny_llama_dir: Path) -> Iterator[GatewayProcess]:
    plans = module_tmp / "plans.yaml"
    plans.write_text(yaml.safe_dump(PLANS))
    engine = tiny_engine(tiny_llama_dir, "tiny")
    engine["args"] += ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    gw = GatewayProcess(
        module_tmp,
        {"redis": {"url": redis_server.url, "plans_file": str(plans)}, "engines": [engine]},
        ROUTING,
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


class Tenant:
    """A fresh tenant of the gateway, its key, and what the gateway has charged it."""

    def __init__(self, gw: GatewayProcess, redis_url: str, **fields: Any) -> None:
        self.gw = gw
        self.id, self.key = gw.create_tenant("metered", **fields)
        self.redis = redis.Redis.from_url(redis_url)
        month = time.strftime("%Y-%m", time.gmtime())
        self.budget_key = f"portico:budget:{{{self.id}}}:t:{month}"

    def charged(self) -> int:
        return int(self.redis.get(self.budget_key) or 0)

    def charged_becomes(self, expected: int) -> int:
        """What was charged once it reaches ``expected`` (settling runs after the response)."""
        wait_until(lambda: self.charged() >= expected, timeout=30)
        time.sleep(0.2)  # a second, wrong charge would land now; none may
        return self.charged()

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            self.gw.base_url + path,
            headers={"authorization": f"Bearer {self.key}"},
            json={"model": "tiny", **body},
            timeout=120,
        )

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Every data event of a streamed answer, parsed (``[DONE]`` as {"done": True})."""
        events: list[dict[str, Any]] = []
        with httpx.stream(
            "POST",
            self.gw.base_url + path,
            headers={"authorization": f"Bearer {self.key}"},
            json={"model": "tiny", "stream": True, **body},
            timeout=120,
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append({"done": True} if data == "[DONE]" else json.loads(data))
        return events


@pytest.fixture
def tenant(gateway: GatewayProcess, redis_server: Any) -> Tenant:
    return Tenant(gateway, redis_server.url)


def total(usage: dict[str, Any]) -> int:
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    return int(prompt) + int(usage.get("completion_tokens", usage.get("output_tokens", 0)))


CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0}


def test_chat_not_streamed_and_streamed(tenant: Tenant) -> None:
    r = tenant.post("/v1/chat/completions", {**CHAT, "max_tokens": 9, "ignore_eos": True})
    assert r.status_code == 200, r.text
    whole = total(r.json()["usage"])
    assert tenant.charged_becomes(whole) == whole
    events = tenant.stream(
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 9, "ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 9
    assert tenant.charged_becomes(whole + total(usage)) == whole + total(usage)
    # a stream without include_usage is charged the same: the engine told the gateway anyway
    events = tenant.stream("/v1/chat/completions", {**CHAT, "max_tokens": 9, "ignore_eos": True})
    assert all(e.get("usage") is None for e in events)  # and the client sees none of it
    expected = whole + 2 * total(usage)
    assert tenant.charged_becomes(expected) == expected


def test_n_completions_streamed_and_not(tenant: Tenant) -> None:
    body = {"prompt": "Once upon a time", "n": 3, "max_tokens": 5, "ignore_eos": True}
    r = tenant.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 15
    assert tenant.charged_becomes(total(usage)) == total(usage)
    events = tenant.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    streamed = events[-2]["usage"]
    assert streamed["completion_tokens"] == 15
    expected = total(usage) + total(streamed)
    assert tenant.charged_becomes(expected) == expected


def test_responses_and_embeddings(tenant: Tenant) -> None:
    r = tenant.post("/v1/responses", {"input": "Hello there.", "max_output_tokens": 6})
    assert r.status_code == 200, r.text
    expected = total(r.json()["usage"])
    assert tenant.charged_becomes(expected) == expected
    events = tenant.stream("/v1/responses", {"input": "Hello there.", "max_output_tokens": 6})
    completed = next(e for e in events if e.get("type") == "response.completed")
    expected += total(completed["response"]["usage"])
    assert tenant.charged_becomes(expected) == expected
    r = tenant.post("/v1/embeddings", {"input": ["one text", "and another one"]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 0
    expected += usage["prompt_tokens"]
    assert tenant.charged_becomes(expected) == expected


def test_tools_and_structured_outputs(tenant: Tenant) -> None:
    r = tenant.post(
        "/v1/chat/completions",
        {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40},
    )
    assert r.status_code == 200, r.text
    expected = total(r.json()["usage"])
    assert tenant.charged_becomes(expected) == expected
    r = tenant.post("/v1/chat/completions", {**CHAT, "response_format": SCHEMA, "max_tokens": 20})
    assert r.status_code == 200, r.text
    expected += total(r.json()["usage"])
    assert tenant.charged_becomes(expected) == expected


def engine_generated(gw: GatewayProcess) -> float:
    """The engine's own count of generated tokens (all requests), read on its socket."""
    transport = httpx.HTTPTransport(uds=str(gw.workdir / "run" / "tiny-0.sock"))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=10) as client:
        text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def test_a_stream_the_client_leaves_is_charged_what_was_generated(
    gateway: GatewayProcess, tenant: Tenant
) -> None:
    before = engine_generated(gateway)
    prompt_usage = tenant.post("/v1/chat/completions", {**CHAT, "max_tokens": 1}).json()["usage"]
    first = total(prompt_usage)
    assert tenant.charged_becomes(first) == first
    generated_before = engine_generated(gateway)
    received = 0
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {tenant.key}"},
        json={"model": "tiny", **CHAT, "max_tokens": 900, "ignore_eos": True, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                received += 1
                if received == 5:
                    break  # the client leaves; closing the response drops the connection
    # the engine stops and frees the request; the gateway settles what it saw generated
    assert wait_until(lambda: tenant.charged() > first, timeout=30)
    time.sleep(0.5)
    charged_completion = tenant.charged() - first - prompt_usage["prompt_tokens"]
    generated = engine_generated(gateway) - generated_before
    assert before <= generated_before
    assert received <= charged_completion <= generated < 900


def test_a_token_budget_stops_the_stream_at_the_exact_token(
    gateway: GatewayProcess, redis_server: Any
) -> None:
    budget = 240
    tenant = Tenant(gateway, redis_server.url, overrides={"monthly_token_budget": budget})
    r = tenant.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
    prompt = r.json()["usage"]["prompt_tokens"]
    assert tenant.charged_becomes(prompt + 1) == prompt + 1
    left = budget - (prompt + 1) - prompt  # what the next request may generate
    assert 0 < left < 300
    events = tenant.stream(
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 300, "ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == {"done": True}
    error = events[-2]["error"]
    assert error["code"] == "insufficient_quota" and "monthly_token_budget" in error["message"]
    usage = events[-3]["usage"]
    assert usage["completion_tokens"] == left  # the engine stopped at the budget, not after
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-3] if e.get("choices")]
    assert finishes[-1] == "length"
    assert tenant.charged_becomes(budget) == budget  # spent to the token, never past it
    r = tenant.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
