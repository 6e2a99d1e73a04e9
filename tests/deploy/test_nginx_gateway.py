"""A real nginx, on the rendered edge config, in front of a real gateway (``portico serve``)
that supervises a real engine process; clients are the ``openai`` SDK over TLS with a test CA.

Proves what only the whole chain can: SSE chunks pass through nginx and the gateway as they
are produced (no buffering anywhere), limit_req refuses a burst at the edge before the gateway
sees it, request ids travel end to end, and the gateway's own errors reach clients unchanged.
"""

from __future__ import annotations

import secrets
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from edge_nginx import EdgeNginx, EdgePKI, default_values, private_edge_dir
from gateway_process import MODEL, GatewayProcess
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.nginx


def _tls(pki: EdgePKI) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    pki.ca.configure_trust(ctx)
    return ctx


def _edge_in_front(gateway: GatewayProcess, pki: EdgePKI, **overrides: str) -> Iterator[EdgeNginx]:
    with private_edge_dir() as folder:
        values = default_values(folder, pki.cert, pki.key, gateway.address)
        values.update(overrides)
        nginx = EdgeNginx(folder, values)
        nginx.start()
        try:
            yield nginx
        finally:
            nginx.stop()


@pytest.fixture(scope="module")
def edge(gateway: GatewayProcess, test_pki: EdgePKI) -> Iterator[EdgeNginx]:
    yield from _edge_in_front(gateway, test_pki)


@pytest.fixture(scope="module")
def api_key(gateway: GatewayProcess) -> str:
    return gateway.create_key("edge-" + secrets.token_hex(4))


def _client(edge: EdgeNginx, pki: EdgePKI, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"https://localhost:{edge.https_port}/v1",
        api_key=api_key,
        http_client=httpx.Client(verify=_tls(pki), timeout=120),
        max_retries=0,
    )


def test_stream_chunks_pass_through_before_the_upstream_finishes(
    edge: EdgeNginx, gateway: GatewayProcess, test_pki: EdgePKI, api_key: str
) -> None:
    # The engine sends "first", then holds the rest until the gate file exists. The gate is
    # opened only after "first" reached this client through nginx and the gateway; had either
    # buffered, "first" would arrive only after the engine's gate timeout, with "gate-timeout".
    gate = "gate-" + secrets.token_hex(6)
    client = _client(edge, test_pki, api_key)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"gate": gate},
        extra_headers={"x-request-id": "edge-stream-1"},
    )
    pieces = []
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) == 1:
                    assert pieces == ["first"]
                    (gateway.gate_dir / gate).touch()
        headers = stream.response.headers
    assert "".join(pieces) == "first released request-id=edge-stream-1"
    assert headers["content-type"].startswith("text/event-stream")
    assert headers.get_list("x-request-id") == ["edge-stream-1"]


def test_request_id_minted_at_the_edge_reaches_the_engine(
    edge: EdgeNginx, test_pki: EdgePKI, api_key: str
) -> None:
    raw = _client(edge, test_pki, api_key).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    minted = raw.headers["x-request-id"]
    assert len(minted) == 32
    assert raw.parse().choices[0].message.content == f"request-id={minted}"
    assert "x-portico-overhead-ms" in raw.headers  # answered by the gateway, through nginx


def test_gateway_errors_reach_the_client_unchanged(edge: EdgeNginx, test_pki: EdgePKI) -> None:
    client = _client(edge, test_pki, "sk-not-a-real-key")
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    body = info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "x-portico-overhead-ms" in info.value.response.headers  # the gateway's, not nginx's


def _requests_seen(gateway: GatewayProcess, tenant: str) -> dict[str, float]:
    seen: dict[str, float] = {}
    for family in text_string_to_metric_families(gateway.metrics()):
        if family.name != "portico_gateway_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("tenant") == tenant:
                seen[sample.labels["status"]] = sample.value
    return seen


def test_a_burst_over_limit_req_is_refused_by_nginx(
    gateway: GatewayProcess, test_pki: EdgePKI
) -> None:
    tenant = "burst-" + secrets.token_hex(4)
    key = gateway.create_key(tenant)
    # 1 request per minute with a burst of 2: three pass at once, the rest are refused until a
    # minute has passed (far longer than this test takes, however slow the machine).
    edge_gen = _edge_in_front(gateway, test_pki, PORTICO_RATE_LIMIT="1r/m", PORTICO_RATE_BURST="2")
    edge = next(edge_gen)
    try:
        client = _client(edge, test_pki, key)
        outcomes = []
        for _ in range(6):
            try:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
                outcomes.append(200)
            except openai.RateLimitError as exc:
                outcomes.append(429)
                refused = exc.response
    finally:
        edge_gen.close()
    assert outcomes == [200, 200, 200, 429, 429, 429]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["retry-after"] == "1"
    assert "x-portico-overhead-ms" not in refused.headers
    # The refused requests never reached the gateway: it counted exactly the three it served.
    assert _requests_seen(gateway, tenant) == {"200": 3.0}


def test_drain_through_the_edge_finishes_streams_and_refuses_new_work(
    tmp_path: Path, redis_url: str, test_pki: EdgePKI
) -> None:
    gateway = GatewayProcess(tmp_path, redis_url)
    gateway.start()
    try:
        key = gateway.create_key("drain-" + secrets.token_hex(4))
        edge_gen = _edge_in_front(gateway, test_pki)
        edge = next(edge_gen)
        try:
            client = _client(edge, test_pki, key)
            gate = "gate-" + secrets.token_hex(6)
            stream = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                extra_body={"gate": gate},
            )
            with stream:
                chunks = iter(stream)
                assert next(chunks).choices[0].delta.content == "first"
                assert gateway.proc is not None
                gateway.proc.send_signal(signal.SIGTERM)  # the drain starts mid-stream
                while httpx.get(gateway.url + "/ready").status_code != 503:
                    time.sleep(0.05)
                with pytest.raises(openai.APIStatusError) as refused:
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "late"}]
                    )
                (gateway.gate_dir / gate).touch()
                rest = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finally:
            edge_gen.close()
        assert refused.value.status_code == 503
        assert refused.value.response.json()["error"]["code"] == "draining"  # the gateway's answer
        assert rest.startswith(" released")
        assert gateway.proc.wait(timeout=60) == 0  # drained, then exited cleanly
    finally:
        gateway.stop()
