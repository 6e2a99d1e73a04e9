"""TLS termination in uvicorn with a test CA (trustme): the client verifies the gateway, and
the admin API requires a client certificate signed by the configured CA."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, fake_engine_command


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_gateway(module_tmp: Path, ca: trustme.CA, redis_server) -> Iterator[GatewayProcess]:  # type: ignore[no-untyped-def]
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = module_tmp / "cert.pem", module_tmp / "key.pem", module_tmp / "ca.pem"
    server_cert.cert_chain_pems[0].write_to_path(str(cert))
    for blob in server_cert.cert_chain_pems[1:]:
        blob.write_to_path(str(cert), append=True)
    server_cert.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": redis_server.url},
            "engines": [{"name": "fake", "command": fake_engine_command()}],
            "tls": {
                "cert_file": str(cert),
                "key_file": str(key),
                "client_ca_file": str(ca_file),
                "admin_requires_client_cert": True,
            },
        },
        {},
    )
    gw.start(timeout=120, verify=client_context(ca))
    yield gw
    assert gw.terminate() == 0, gw.log()


def client_context(ca: trustme.CA, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if with_cert:
        ca.issue_cert("admin@example.test").configure_cert(ctx)
    return ctx


def test_openai_client_talks_to_the_gateway_over_verified_tls(
    tls_gateway: GatewayProcess, ca: trustme.CA
) -> None:
    admin_ctx = client_context(ca, with_cert=True)
    _, key = tls_gateway.create_tenant("standard", verify=admin_ctx)
    client = openai.OpenAI(
        base_url=tls_gateway.base_url + "/v1",
        api_key=key,
        max_retries=0,
        http_client=httpx.Client(verify=client_context(ca)),
    )
    reply = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content == " tok tok"


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_gateway: GatewayProcess) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(tls_gateway.base_url + "/health", verify=ssl.create_default_context())


def test_old_tls_versions_are_refused(tls_gateway: GatewayProcess, ca: trustme.CA) -> None:
    ctx = client_context(ca)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    with pytest.raises(httpx.ConnectError):
        httpx.get(tls_gateway.base_url + "/health", verify=ctx)


def test_admin_api_requires_a_client_certificate(
    tls_gateway: GatewayProcess, ca: trustme.CA
) -> None:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    url = tls_gateway.base_url + "/admin/v1/tenants"
    without = httpx.get(url, headers=headers, verify=client_context(ca))
    assert without.status_code == 403
    assert without.json()["error"]["code"] == "client_certificate_required"
    with_cert = httpx.get(url, headers=headers, verify=client_context(ca, with_cert=True))
    assert with_cert.status_code == 200


def test_a_certificate_from_another_ca_fails_the_handshake(
    tls_gateway: GatewayProcess, ca: trustme.CA
) -> None:
    ctx = client_context(ca)
    trustme.CA().issue_cert("intruder@example.test").configure_cert(ctx)
    with pytest.raises(httpx.HTTPError):
        httpx.get(
            tls_gateway.base_url + "/admin/v1/tenants",
            verify=ctx,
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
        )
