"""The gateway end to end over fast real upstreams: ``portico serve`` supervising two fake
engines (load/fake_upstream.py on Unix sockets) and an OpenAI-compatible remote tier (the lean
transport; more remote cases in test_remote_tiers.py).

These prove the relay, routing, errors, rate-limit headers and slot accounting quickly; the
tests with real inference engines are in test_gateway_engines.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.dataplane.harness import (
    ADMIN_KEY,
    GatewayProcess,
    fake_engine_command,
    free_port,
    live_slots,
    wait_until,
)

ROUTING = {
    "aliases": {"quick": "fake"},
    "tiers": [
        {"name": "small", "model": "fake", "max_score": 1.0},
        {"name": "large", "model": "remote"},
    ],
    "keywords": ["prove"],
}
RETRY = {
    "max_attempts": 3,
    "base_backoff_s": 0.01,
    "max_backoff_s": 0.05,
    "eject_after_failures": 50,
    "eject_cooldown_s": 0.5,
}


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, redis_server, fake_remote: str) -> Iterator[GatewayProcess]:  # type: ignore[no-untyped-def]
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url},
            "engines": [{"name": "fake", "replicas": 2, "command": fake_engine_command()}],
            "remotes": [
                {
                    "name": "remote",
                    "model": "openai/remote",
                    "api_base": fake_remote + "/v1",
                    "api_key_env": "HOME",
                }
            ],
        },
        ROUTING,
        RETRY,
    )
    gw.start(timeout=120)
    yield gw
    assert gw.terminate() == 0, gw.log()


@pytest.fixture(scope="module")
def tenant(gateway: GatewayProcess) -> tuple[str, str]:
    return gateway.create_tenant("standard")


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def test_chat_through_the_openai_client_with_gateway_headers(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    raw = client(gateway, tenant[1]).chat.completions.with_raw_response.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_headers={"x-request-id": "req-123"},
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == " tok tok tok"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert raw.headers["x-request-id"] == "req-123"
    assert float(raw.headers["x-portico-overhead-ms"]) >= 0
    assert raw.headers["x-portico-route"].startswith("tier=direct; model=fake")
    assert int(raw.headers["x-ratelimit-limit-requests"]) > 0


def test_stream_through_the_openai_client_hides_usage_unless_asked(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    chunks = list(oa.completions.create(model="quick", prompt="hi", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 4
    assert all(c.usage is None for c in chunks)
    chunks = list(
        oa.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def _timed_stream(http: httpx.Client, url: str, body: dict, headers: dict) -> list[float]:
    """Arrival times of the content events of one streamed completion."""
    times = []
    start = time.perf_counter()
    with http.stream("POST", url, json=body, headers=headers) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - start)
    return times


def test_stream_timing_through_the_gateway_matches_a_direct_call(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    body = {
        "model": "fake",
        "prompt": "hi",
        "max_tokens": 8,
        "stream": True,
        "fake_chunk_delay_ms": 60,
    }
    direct = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(gateway.workdir / "run" / "fake-0.sock")), timeout=30
    )
    via = httpx.Client(timeout=30)
    d = _timed_stream(direct, "http://engine/v1/completions", body, {})
    g = _timed_stream(
        via, gateway.base_url + "/v1/completions", body, {"authorization": f"Bearer {tenant[1]}"}
    )
    assert len(d) == len(g) == 8
    # Chunk by chunk, not buffered: the upstream sleeps 60 ms between its 8 chunks, so chunks
    # forwarded as they come arrive spread over at least 7 x 60 ms; a buffering proxy would
    # deliver them together. Only lower bounds, which load cannot break: a busy machine makes
    # the upstream's sleeps longer, never shorter. (No upper bound on the gateway's added
    # latency: that is measured by load/gateway_bench.py, not asserted here.)
    assert g[-1] - g[0] >= 0.5 * 7 * 0.060


def test_auto_routes_by_complexity_and_reaches_the_remote_tier(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    easy = oa.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert easy.headers["x-portico-route"].startswith("tier=small; model=fake; reason=auto")
    hard_messages = [{"role": "user", "content": "prove this:\n```\nx = 1\n```"}]
    hard = oa.chat.completions.with_raw_response.create(
        model="auto", messages=hard_messages, max_tokens=3
    )
    assert hard.headers["x-portico-route"].startswith("tier=large; model=remote")
    reply = hard.parse()
    assert reply.model == "remote" and reply.choices[0].message.content.strip() == "tok tok tok"
    stream = oa.chat.completions.create(
        model="auto", messages=hard_messages, max_tokens=3, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip() == "tok tok tok"


def test_models_lists_what_the_plan_allows(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant("standard", allowed_models=["remote"])
    ids = [m.id for m in client(gateway, key).models.list()]
    assert ids == ["remote", "auto"]
    with pytest.raises(openai.PermissionDeniedError):
        client(gateway, key).chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}]
        )


def test_models_lists_each_model_once_with_its_aliases(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    cards = {m.id: m.model_dump() for m in oa.models.list()}
    assert list(cards) == ["fake", "remote", "auto"]  # "quick" is no card of its own
    assert cards["fake"]["aliases"] == ["quick"] and cards["remote"]["aliases"] == []
    assert cards["auto"]["routes_to"] == ["fake", "remote"]
    alias = oa.models.retrieve("quick").model_dump()
    assert (alias["id"], alias["alias_of"]) == ("quick", "fake")
    assert oa.models.retrieve("fake").model_dump()["aliases"] == ["quick"]
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("nothing")
    reply = oa.chat.completions.create(
        model="quick", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices  # an alias still serves requests
    # a plan that names only the alias sees the alias, marked, not the model behind it
    _, key = gateway.create_tenant("standard", allowed_models=["quick"])
    only = [m.model_dump() for m in client(gateway, key).models.list()]
    assert [(m["id"], m.get("alias_of")) for m in only] == [("quick", "fake")]


def test_errors_have_openai_shape_and_overhead_header(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    url = gateway.base_url + "/v1/chat/completions"
    auth = {"authorization": f"Bearer {tenant[1]}"}
    cases = [
        (httpx.post(url, json={"model": "fake", "messages": []}), 401),
        (httpx.post(url, content=b"{oops", headers=auth), 400),
        (
            httpx.post(
                url,
                json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                headers=auth,
            ),
            404,
        ),
        (httpx.post(url, content=b"x" * (5 * 1024 * 1024), headers=auth), 413),
    ]
    for resp, status in cases:
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert "x-portico-overhead-ms" in resp.headers and "x-request-id" in resp.headers


def test_rate_limit_429_and_its_headers_pass_through(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant("standard", overrides={"requests_per_minute": 2})
    oa = client(gateway, key)
    for _ in range(2):
        oa.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    with pytest.raises(openai.RateLimitError) as exc:
        oa.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    headers = exc.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    metrics = httpx.get(gateway.base_url + "/metrics").text
    assert 'portico_gateway_rate_limited_total{limit="requests_per_minute"}' in metrics


def test_client_disconnect_mid_stream_releases_the_slot(
    gateway: GatewayProcess, redis_server
) -> None:  # type: ignore[no-untyped-def]
    tenant_id, key = gateway.create_tenant("standard", overrides={"max_concurrency": 1})
    body = {
        "model": "fake",
        "prompt": "hi",
        "max_tokens": 200,
        "stream": True,
        "fake_chunk_delay_ms": 100,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            gateway.base_url + "/v1/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()  # keep the iterator: dropping it closes the response
        next(lines)
        assert live_slots(redis_server.url, tenant_id) == 1
        # the one slot is taken: a second request is refused while the stream runs
        second = httpx.post(
            gateway.base_url + "/v1/completions",
            json={**body, "stream": False},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert second.status_code == 429
    assert wait_until(lambda: live_slots(redis_server.url, tenant_id) == 0, timeout=15)
    reply = client(gateway, key).completions.create(model="fake", prompt="x", max_tokens=1)
    assert reply.choices[0].text == " tok"


def test_retryable_upstream_status_is_retried_then_passed_through(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    def retries() -> float:
        text = httpx.get(gateway.base_url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('portico_gateway_retries_total{reason="503"')
        )

    before = retries()
    resp = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": "fake", "prompt": "x", "fake_status": 503},
        headers={"authorization": f"Bearer {tenant[1]}"},
        timeout=30,
    )
    assert resp.status_code == 503
    assert retries() - before == 2  # max_attempts 3
    not_retried = httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": "fake", "prompt": "x", "fake_status": 400},
        headers={"authorization": f"Bearer {tenant[1]}"},
        timeout=30,
    )
    assert not_retried.status_code == 400 and retries() - before == 2


def test_usage_is_recorded_for_the_tenant(gateway: GatewayProcess) -> None:
    tenant_id, key = gateway.create_tenant("standard")
    client(gateway, key).completions.create(model="fake", prompt="hello", max_tokens=5)
    list(
        client(gateway, key).completions.create(
            model="fake", prompt="hello", max_tokens=7, stream=True
        )
    )

    def usage() -> dict:
        r = httpx.get(
            f"{gateway.base_url}/admin/v1/tenants/{tenant_id}/usage",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
        return r.json()

    assert wait_until(
        lambda: (
            json.dumps(usage()).count('"completion_tokens": 12') > 0
            or usage().get("total", {}).get("completion_tokens") == 12
        ),
        timeout=10,
    ), usage()


def test_health_ready_and_metrics_show_the_engines(gateway: GatewayProcess) -> None:
    health = gateway.health()
    assert [e["state"] for e in health["engines"]] == ["ready", "ready"]
    metrics = httpx.get(gateway.base_url + "/metrics").text
    for name in (
        "portico_gateway_requests_total",
        "portico_gateway_overhead_seconds_bucket",
        "portico_gateway_time_to_first_byte_seconds_bucket",
        'portico_gateway_engine_up{engine="fake-0"} 1.0',
        "portico_gateway_requests_in_flight",
    ):
        assert name in metrics


def test_unreachable_litellm_remote_is_retried_then_502(module_tmp: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    gw = GatewayProcess(
        module_tmp / "dead",
        {
            "redis": {"url": redis_server.url},
            "engines": [{"name": "fake", "command": fake_engine_command()}],
            "remotes": [
                {
                    "name": "gone",
                    "model": "openai/gone",
                    "api": "litellm",  # the lean path's dead remote: test_remote_tiers.py
                    "api_base": dead,
                    "api_key_env": "HOME",
                    "timeout_s": 5,
                }
            ],
        },
        {},
        RETRY,
    )
    gw.start(timeout=120)
    try:
        _, key = gw.create_tenant("standard")
        resp = httpx.post(
            gw.base_url + "/v1/chat/completions",
            timeout=60,
            headers={"authorization": f"Bearer {key}"},
            json={"model": "gone", "messages": [{"role": "user", "content": "x"}]},
        )
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "upstream_error"
        metrics = httpx.get(gw.base_url + "/metrics").text
        assert 'portico_gateway_retries_total{reason="connect",upstream="gone"} 2.0' in metrics
    finally:
        gw.terminate()
