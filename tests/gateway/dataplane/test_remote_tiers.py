"""Remote tiers end to end: ``portico serve`` in front of fake OpenAI-compatible (and Anthropic)
providers (load/fake_upstream.py on TCP, one with TLS and a client-certificate requirement),
called through the real ``openai`` client.

Proves: the lean transport path (stream and not, usage hidden unless asked), Azure's path and
``api-key``, a private CA and a client certificate (and refusal without either), retries and
ejection like engines, fallback from a dead tier and from a tier over its latency budget, usage
counted by the gateway when a provider reports none (and said so in the usage record), tenants'
own provider keys (sealed in Redis, never returned, never echoed), and litellm translation to
Anthropic's API.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import trustme

from tests.gateway.dataplane.harness import (
    ADMIN_KEY,
    REPO_ROOT,
    GatewayProcess,
    answers,
    fake_engine_command,
    free_port,
    wait_until,
)

UPSTREAM_KEY = "sk-upstream-secret-0123456789abcdef"
TENANT_KEY = "sk-tenant-own-key-fedcba9876543210"
KEY_ENV = "PORTICO_TEST_UPSTREAM_KEY"
RETRY = {
    "max_attempts": 3,
    "base_backoff_s": 0.01,
    "max_backoff_s": 0.02,
    "eject_after_failures": 3,
    "eject_cooldown_s": 60,
    "connect_timeout_s": 2,
}
ROUTING = {
    "keywords": ["prove"],
    "tiers": [
        # "hi" scores ~0.1: the dead tier, which falls back to the live one
        {"name": "down", "model": "dead", "max_score": 0.5, "fallbacks": ["live"]},
        # a keyword scores 1+: a tier over its latency budget falls back too
        {
            "name": "slow",
            "model": "lean",
            "max_score": 2.0,
            "latency_budget_s": 0.3,
            "fallbacks": ["live"],
        },
        # a keyword and three code blocks score 4+: a tier out of quota (429) falls back
        {"name": "quota", "model": "over-quota", "max_score": 10.0, "fallbacks": ["live"]},
        {"name": "live", "model": "nousage"},
    ],
}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _fake(*args: str, module: str = "load.fake_upstream") -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return proc, port


@pytest.fixture(scope="module")
def certs(module_tmp: Path) -> dict[str, Path]:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gateway@portico.test")
    out = {
        "ca": module_tmp / "ca.pem",
        "server": module_tmp / "server.pem",
        "client": module_tmp / "client.pem",
    }
    ca.cert_pem.write_to_path(str(out["ca"]))
    server.private_key_and_cert_chain_pem.write_to_path(str(out["server"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(out["client"]))
    return out


@pytest.fixture(scope="module")
def fakes(certs: dict[str, Path]) -> Iterator[dict[str, int]]:
    started = {
        "keyed": _fake("--model", "up", "--require-key", UPSTREAM_KEY, TENANT_KEY),
        "nousage": _fake("--no-usage"),
        "flaky": _fake("--fail-first", "2"),
        "quota": _fake("--status", "429"),
        "h2": _fake(
            "--tls-cert",
            str(certs["server"]),
            "--tls-key",
            str(certs["server"]),
            module="load.fake_h2_upstream",
        ),
        "tls": _fake(
            "--tls-cert",
            str(certs["server"]),
            "--tls-key",
            str(certs["server"]),
            "--tls-client-ca",
            str(certs["ca"]),
        ),
    }
    try:
        for name, (_, port) in started.items():
            if name not in ("tls", "h2"):
                assert wait_until(lambda p=port: answers(f"http://127.0.0.1:{p}/health"), 30)
            else:
                assert wait_until(lambda p=port: _listening(p), 30)
        yield {name: port for name, (_, port) in started.items()}
    finally:
        for proc, _ in started.values():
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def gateway(
    module_tmp: Path,
    redis_server,  # type: ignore[no-untyped-def]
    fakes: dict[str, int],
    certs: dict[str, Path],
    tiny_llama_dir: Path,
) -> Iterator[GatewayProcess]:
    key_file = module_tmp / "upstream.key"
    key_file.write_text(UPSTREAM_KEY + "\n")
    keyed = f"http://127.0.0.1:{fakes['keyed']}"
    secure = f"https://localhost:{fakes['tls']}/v1"
    remotes = [
        {"name": "lean", "model": "openai/up", "api_base": keyed + "/v1",
         "api_key_file": str(key_file)},
        {"name": "azure", "model": "azure/dep-1", "api_base": keyed, "api_version": "2024-10-21",
         "api_key_env": KEY_ENV},
        {"name": "byok", "model": "openai/up", "api_base": keyed + "/v1",
         "api_key_env": KEY_ENV, "tenant_keys": True},
        {"name": "nousage", "model": "openai/plain",
         "api_base": f"http://127.0.0.1:{fakes['nousage']}/v1"},
        {"name": "counted", "model": "openai/plain", "tokenizer": str(tiny_llama_dir),
         "api_base": f"http://127.0.0.1:{fakes['nousage']}/v1"},
        {"name": "flaky", "model": "openai/f", "api_base": f"http://127.0.0.1:{fakes['flaky']}/v1"},
        {"name": "over-quota", "model": "openai/q",
         "api_base": f"http://127.0.0.1:{fakes['quota']}/v1"},
        {"name": "dead", "model": "openai/d", "api_base": f"http://127.0.0.1:{free_port()}/v1"},
        {"name": "secure", "model": "openai/s", "api_base": secure, "ca_file": str(certs["ca"]),
         "client_cert_file": str(certs["client"])},
        {"name": "secure-h2", "model": "openai/s", "api_base": secure, "http2": True,
         "ca_file": str(certs["ca"]), "client_cert_file": str(certs["client"])},
        {"name": "h2-only", "model": "openai/m", "http2": True, "ca_file": str(certs["ca"]),
         "api_base": f"https://localhost:{fakes['h2']}/v1"},
        {"name": "public-roots", "model": "openai/s", "api_base": secure,
         "client_cert_file": str(certs["client"])},
        {"name": "no-client-cert", "model": "openai/s", "api_base": secure,
         "ca_file": str(certs["ca"])},
        {"name": "claude", "model": "anthropic/claude-3-5-haiku-20241022", "api_base": keyed,
         "api_key_env": KEY_ENV},
        {"name": "claude-bad-key", "model": "anthropic/claude-3-5-haiku-20241022",
         "api_base": keyed, "api_key_env": KEY_ENV + "_WRONG"},
        {"name": "via-litellm", "model": "openai/up", "api": "litellm",
         "api_base": keyed + "/v1", "api_key_env": KEY_ENV},
    ]  # fmt: skip
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url},
            "engines": [],
            "remotes": remotes,
        },
        ROUTING,
        RETRY,
    )
    mp = pytest.MonkeyPatch()
    mp.setenv(KEY_ENV, UPSTREAM_KEY)
    mp.setenv(KEY_ENV + "_WRONG", "sk-wrong-gateway-key-0000000000LMNO")
    try:
        gw.start(timeout=120)
        yield gw
    finally:
        mp.undo()
        gw.terminate()


@pytest.fixture(scope="module")
def tenant(gateway: GatewayProcess) -> tuple[str, str]:
    return gateway.create_tenant("standard")


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def ask(oa: openai.OpenAI, model: str, **kw: Any) -> Any:
    """A one-message chat completion (a stream when ``stream=True``)."""
    return oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], **kw
    )


def ask_raw(oa: openai.OpenAI, model: str, **kw: Any) -> Any:
    """The same, with the response's headers (``.headers``, ``.parse()``)."""
    create: Any = oa.chat.completions.with_raw_response.create
    return create(model=model, messages=[{"role": "user", "content": "hi"}], **kw)


def metric(gateway: GatewayProcess, prefix: str) -> float:
    text = httpx.get(gateway.base_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def test_remote_over_the_lean_transport_through_the_openai_client(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    raw = ask_raw(oa, "lean", max_tokens=3)
    reply = raw.parse()
    assert reply.choices[0].message.content == " tok tok tok"
    assert reply.model == "up"  # the provider's name of the model, as OpenAI reports its own
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert raw.headers["x-portico-route"].startswith("tier=direct; model=lean")
    chunks = list(ask(oa, "lean", max_tokens=4, stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " tok" * 4
    assert all(c.usage is None for c in chunks)  # the usage the gateway asked for is hidden
    asked = list(
        oa.completions.create(
            model="lean",
            prompt="hi",
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 2


def test_azure_path_api_version_and_api_key_header(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    reply = ask(client(gateway, tenant[1]), "azure", max_tokens=2)
    assert reply.choices[0].message.content == " tok tok"
    assert reply.model == "dep-1"


def test_tls_with_a_private_ca_and_a_client_certificate(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    assert ask(oa, "secure", max_tokens=2).choices[0].message.content == " tok tok"
    chunks = list(oa.completions.create(model="secure", prompt="x", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 3
    # http2: httpx's transport, offering h2 by ALPN; this server takes HTTP/1.1 only
    assert ask(oa, "secure-h2", max_tokens=1).choices[0].message.content == " tok"
    # ... and this one HTTP/2 only: an answer means it was spoken
    reply = ask(oa, "h2-only", max_tokens=2)
    assert reply.model == "h2:m" and reply.choices[0].message.content == " tok tok"
    chunks = list(oa.completions.create(model="h2-only", prompt="x", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 3
    # Verification is on: a CA it does not trust, or no client certificate, and no answer.
    for model in ("public-roots", "no-client-cert"):
        with pytest.raises(openai.APIStatusError) as exc:
            ask(oa, model, max_tokens=1)
        assert exc.value.status_code == 502
        assert exc.value.body["code"] == "upstream_unavailable"  # type: ignore[index]


def test_retries_then_success_and_ejection_of_a_dead_remote(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    reply = ask(oa, "flaky", max_tokens=1)
    assert reply.choices[0].message.content == " tok"  # 503, 503, then the answer
    assert metric(gateway, 'portico_gateway_retries_total{reason="503",upstream="flaky"}') == 2
    with pytest.raises(openai.APIStatusError) as exc:
        ask(oa, "dead", max_tokens=1)
    assert exc.value.status_code == 502
    assert metric(gateway, 'portico_gateway_retries_total{reason="connect",upstream="dead"}') >= 2
    # three consecutive failures ejected it: refused at once, without an attempt
    assert metric(gateway, 'portico_gateway_ejections_total{replica="dead-0",upstream="dead"}') == 1
    with pytest.raises(openai.APIStatusError) as exc:
        ask(oa, "dead", max_tokens=1)
    assert exc.value.status_code == 503
    assert exc.value.body["code"] == "no_healthy_replica"  # type: ignore[index]


def test_fallback_from_a_dead_tier_and_from_a_slow_one(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    raw = ask_raw(oa, "auto", max_tokens=2)
    route = raw.headers["x-portico-route"]
    assert route.startswith("tier=live; model=nousage; reason=auto"), route
    assert "fallback from down (" in route
    assert raw.parse().choices[0].message.content == " tok tok"
    stream = ask(oa, "auto", max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " tok tok"
    slow = oa.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "prove it"}],
        max_tokens=1,
        extra_body={"fake_chunk_delay_ms": 1500},
    )
    assert slow.headers["x-portico-route"].startswith("tier=live; model=nousage")
    assert "fallback from slow (latency_budget)" in slow.headers["x-portico-route"]
    assert metric(gateway, 'portico_gateway_fallbacks_total{from_tier="slow"') == 1
    code = "prove these:\n```\na\n```\n```\nb\n```\n```\nc\n```"
    quota = oa.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": code}], max_tokens=1
    )
    assert "; fallback from quota (status_429)" in quota.headers["x-portico-route"]
    assert quota.parse().choices[0].message.content == " tok"


def test_a_tier_whose_model_is_out_of_quota_here_falls_back(gateway: GatewayProcess) -> None:
    _, key = gateway.create_tenant(
        "standard", model_limits={"dead": {"requests_per_minute": 0}}
    )  # the tier's model may take nothing from this tenant: admission refuses it, not the tier
    raw = ask_raw(client(gateway, key), "auto", max_tokens=1)
    assert "fallback from down (quota_requests_per_minute)" in raw.headers["x-portico-route"]
    assert raw.headers["x-portico-route"].startswith("tier=live; model=nousage")


def test_a_remote_stream_is_relayed_chunk_by_chunk(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    arrivals = []
    started = time.perf_counter()
    with httpx.stream(
        "POST",
        gateway.base_url + "/v1/completions",
        json={
            "model": "lean",
            "prompt": "x",
            "max_tokens": 8,
            "stream": True,
            "fake_chunk_delay_ms": 60,
        },  # fmt: skip
        headers={"authorization": f"Bearer {tenant[1]}"},
        timeout=30,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) == 8
    # the fake sleeps 60 ms between chunks: relayed as they come, they arrive spread out
    # (a lower bound only: load makes the sleeps longer, never shorter)
    assert arrivals[-1] - arrivals[0] >= 0.5 * 7 * 0.060


def test_usage_without_a_provider_report_is_counted_and_said_so(
    gateway: GatewayProcess, tiny_llama_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tenant_id, key = gateway.create_tenant("standard")
    oa = client(gateway, key)
    ask(oa, "nousage", max_tokens=5)
    list(oa.completions.create(model="nousage", prompt="hi", max_tokens=7, stream=True))
    list(oa.completions.create(model="counted", prompt="hi", max_tokens=6, stream=True))
    expected = len(
        AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(
            " tok" * 6, add_special_tokens=False
        )
    )

    def usage() -> dict:
        return httpx.get(
            f"{gateway.base_url}/admin/v1/tenants/{tenant_id}/usage",
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        ).json()

    assert wait_until(lambda: usage()["totals"]["requests"] == 3, timeout=10), usage()
    models = usage()["models"]
    # " tok" * n is 4n characters: the ~4 characters per token rule gives n
    assert models["nousage"]["completion_tokens"] == 12
    assert models["nousage"]["requests_counted_estimate"] == 2
    assert models["counted"]["completion_tokens"] == expected
    assert models["counted"]["requests_counted_tokenizer"] == 1
    assert models["nousage"]["prompt_tokens"] > 0  # admission's own count
    counted = 'portico_gateway_usage_counted_total{model="nousage",source="estimate"}'
    assert metric(gateway, counted) >= 2


def test_tenant_provider_keys_are_sealed_never_returned_never_echoed(
    gateway: GatewayProcess,
    redis_server,  # type: ignore[no-untyped-def]
) -> None:
    tenant_id, key = gateway.create_tenant("standard")
    admin = httpx.Client(
        base_url=gateway.base_url + "/admin/v1",
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    wrong = "sk-wrong-key-00000000000000WXYZ"
    url = f"/tenants/{tenant_id}/provider_keys"
    assert admin.put(f"{url}/byok", json={"key": wrong}).status_code == 200
    oa = client(gateway, key)
    with pytest.raises(openai.APIStatusError) as exc:  # the provider's 401 echoes the key's end
        ask(oa, "byok", max_tokens=1)
    assert exc.value.status_code == 502
    assert exc.value.body["code"] == "upstream_auth_error"  # type: ignore[index]
    assert "WXYZ" not in exc.value.response.text
    r = admin.put(f"/tenants/{tenant_id}/provider_keys/byok", json={"key": TENANT_KEY})
    assert r.status_code == 200 and TENANT_KEY not in r.text
    assert wait_until(
        lambda: _works(oa, "byok"), timeout=10
    )  # the replica's cache of the old key expires
    listing = admin.get(f"/tenants/{tenant_id}/provider_keys")
    assert [row["remote"] for row in listing.json()["data"]] == ["byok"]
    assert TENANT_KEY not in listing.text
    stored = redis.Redis.from_url(redis_server.url).hget(
        f"portico:provider_keys:{{{tenant_id}}}", "byok"
    )
    assert stored is not None and TENANT_KEY.encode() not in stored
    assert admin.put(f"{url}/lean", json={"key": TENANT_KEY}).status_code == 404
    assert admin.put(f"/tenants/{tenant_id}/provider_keys/byok", json={"k": 1}).status_code == 400
    assert admin.delete(f"/tenants/{tenant_id}/provider_keys/byok").status_code == 200
    assert httpx.put(
        f"{gateway.base_url}/admin/v1/tenants/{tenant_id}/provider_keys/byok",
        json={"key": TENANT_KEY},
        headers={"authorization": f"Bearer {key}"},
    ).status_code in (401, 403)
    # without the tenant's key, the configured one serves it
    assert _works(oa, "byok")
    log = gateway.log_path.read_text(errors="replace")
    metrics = httpx.get(gateway.base_url + "/metrics").text
    audit = admin.get("/audit", params={"tenant_id": tenant_id, "action": "provider_key."})
    actions = [entry["action"] for entry in audit.json()["data"]]
    assert actions.count("provider_key.set") == 2 and actions.count("provider_key.delete") == 1
    for secret in (UPSTREAM_KEY, TENANT_KEY, wrong, wrong[-8:]):
        assert secret not in log and secret not in metrics and secret not in audit.text


def _works(oa: openai.OpenAI, model: str) -> bool:
    try:
        ask(oa, model, max_tokens=1)
    except openai.APIStatusError:
        return False
    return True


def test_translation_tier_through_litellm_against_a_fake_anthropic(
    gateway: GatewayProcess, tenant: tuple[str, str]
) -> None:
    oa = client(gateway, tenant[1])
    reply = ask(oa, "claude", max_tokens=3)
    assert reply.model == "claude"
    assert (reply.choices[0].message.content or "").strip() == "tok tok tok"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    stream = ask(oa, "claude", max_tokens=2, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == "tok tok"
    )
    with pytest.raises(openai.APIStatusError) as exc:  # the provider refused *our* key: 502
        ask(oa, "claude-bad-key", max_tokens=1)
    assert exc.value.status_code == 502
    assert exc.value.body["code"] == "upstream_auth_error"  # type: ignore[index]
    assert "LMNO" not in exc.value.response.text
    forced = ask(oa, "via-litellm", max_tokens=2)
    assert (forced.choices[0].message.content or "").strip() == "tok tok"


def test_a_missing_upstream_credential_stops_the_start(module_tmp: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    gw = GatewayProcess(
        module_tmp / "nokey",
        {
            "redis": {"url": redis_server.url},
            "engines": [{"name": "fake", "command": fake_engine_command()}],
            "remotes": [
                {"name": "x", "model": "openai/x", "api_key_env": "PORTICO_TEST_UNSET_VARIABLE"}
            ],
        },
        {},
    )
    with pytest.raises(RuntimeError, match="PORTICO_TEST_UNSET_VARIABLE"):
        gw.start(timeout=60)
