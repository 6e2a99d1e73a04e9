"""The gateway end to end with REAL engine processes (tiny Llama, two replicas) supervised by a
real ``portico serve``, driven by the real ``openai`` client with a tenant's key, real Redis.

Engines start once for the module. The two tests that kill a replica run last; each waits for
the supervisor to bring the pool back before it starts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.dataplane.harness import GatewayProcess, live_slots, tiny_engine, wait_until

pytestmark = pytest.mark.slow

ROUTING = {
    "tiers": [
        {"name": "small", "model": "tiny", "max_score": 1.0},
        {"name": "large", "model": "remote"},
    ],
    "keywords": ["prove"],
}
RETRY = {
    "max_attempts": 4,
    "base_backoff_s": 0.02,
    "max_backoff_s": 0.2,
    "eject_after_failures": 2,
    "eject_cooldown_s": 1.0,
}


@pytest.fixture(scope="module")
def gateway(
    module_tmp: Path,
    redis_server,
    tiny_llama_dir: Path,  # type: ignore[no-untyped-def]
    fake_remote: str,
) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url},
            "engines": [tiny_engine(tiny_llama_dir, "tiny", replicas=2)],
            "remotes": [
                {
                    "name": "remote",
                    "model": "openai/remote",
                    "api_base": fake_remote + "/v1",
                    "api_key_env": "HOME",
                }
            ],
            "supervisor": {"backoff_base_s": 0.2},
        },
        ROUTING,
        RETRY,
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


@pytest.fixture(scope="module")
def key(gateway: GatewayProcess) -> str:
    return gateway.create_tenant("standard")[1]


def oa(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def all_ready(gateway: GatewayProcess) -> bool:
    return all(e["state"] == "ready" and e["up"] for e in gateway.health()["engines"])


def test_chat_streaming_and_not_give_the_same_greedy_text(
    gateway: GatewayProcess, key: str
) -> None:
    client = oa(gateway, key)
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.model == "tiny" and reply.usage is not None
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_admission_reserves_exactly_the_engines_prompt_tokens(gateway: GatewayProcess) -> None:
    # A fresh tenant's tokens/min bucket is full: what the response says is left is the limit
    # minus the reservation, prompt tokens as the gateway counted them plus max_tokens.
    _, key = gateway.create_tenant("standard")
    raw = oa(gateway, key).chat.completions.with_raw_response.create(
        model="tiny",
        max_tokens=7,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    )
    usage = raw.parse().usage
    assert usage is not None
    limit = int(raw.headers["x-ratelimit-limit-tokens"])
    reserved = limit - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert reserved == usage.prompt_tokens + 7


def test_completions_and_models(gateway: GatewayProcess, key: str) -> None:
    client = oa(gateway, key)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt="Once upon", max_tokens=5, temperature=0
    )
    assert raw.parse().choices[0].text
    assert "x-portico-overhead-ms" in raw.headers
    assert {m.id for m in client.models.list()} >= {"tiny", "remote", "auto"}


def test_auto_picks_tiers_as_the_policy_says(gateway: GatewayProcess, key: str) -> None:
    client = oa(gateway, key)
    easy = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert easy.headers["x-portico-route"].startswith("tier=small; model=tiny")
    assert easy.parse().model == "tiny"
    hard = client.chat.completions.with_raw_response.create(
        model="auto",
        max_tokens=4,
        messages=[{"role": "user", "content": "prove it:\n```\nfn main() {}\n```"}],
    )
    assert hard.headers["x-portico-route"].startswith("tier=large; model=remote")
    assert hard.parse().model == "remote"


def test_sigkill_of_one_replica_under_load_loses_no_request(gateway: GatewayProcess) -> None:
    assert wait_until(lambda: all_ready(gateway), timeout=300)
    _, key = gateway.create_tenant("standard", overrides={"max_concurrency": 64})
    victim = gateway.health()["engines"][0]
    client = oa(gateway, key)
    results: list[object] = []
    started = threading.Barrier(25)

    def call(i: int) -> None:
        started.wait()
        try:
            r = client.completions.create(
                model="tiny",
                prompt=f"request {i}",
                max_tokens=48,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            results.append(r.usage.completion_tokens if r.usage else None)
        except Exception as exc:  # recorded and asserted below
            results.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    started.wait()
    assert wait_until(lambda: any(e["outstanding"] for e in gateway.health()["engines"]), 30)
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert results == [48] * 24, results
    # the supervisor restarts the killed replica and the pool is whole again
    assert wait_until(lambda: all_ready(gateway), timeout=300), gateway.health()
    restarted = next(e for e in gateway.health()["engines"] if e["name"] == victim["name"])
    assert restarted["restarts"] >= 1 and restarted["pid"] != victim["pid"]
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert f'portico_gateway_engine_restarts_total{{engine="{victim["name"]}"}}' in metrics


def test_engine_crash_mid_stream_ends_the_stream_and_frees_the_slot(
    gateway: GatewayProcess, redis_server
) -> None:  # type: ignore[no-untyped-def]
    assert wait_until(lambda: all_ready(gateway), timeout=300)
    tenant_id, key = gateway.create_tenant("standard", overrides={"max_concurrency": 2})
    body = {
        "model": "tiny",
        "prompt": "Tell a long story",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with (
        httpx.Client(timeout=120) as http,
        http.stream(
            "POST",
            gateway.base_url + "/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        events.append(next(line for line in lines if line.startswith("data:")))
        assert live_slots(redis_server.url, tenant_id) == 1
        serving = [e for e in gateway.health()["engines"] if e["outstanding"]]
        assert len(serving) == 1
        os.kill(serving[0]["pid"], signal.SIGKILL)
        events += [line for line in lines if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])
    assert error["error"]["type"] == "upstream_error"
    assert len(events) < 900  # cut short, not completed by someone else
    assert wait_until(lambda: live_slots(redis_server.url, tenant_id) == 0, timeout=15)
    assert wait_until(lambda: all_ready(gateway), timeout=300), gateway.health()
