"""nginx/portico.conf.template: it renders, `nginx -t` accepts it, and a real nginx running it
behaves as an edge should even before any gateway answers (TLS, HTTP/2, redirect, error shapes).

The gateway-backed behaviour (SSE passthrough, limit_req, request ids) is in
test_nginx_gateway.py.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from edge_nginx import REPO_ROOT, TEMPLATE, EdgeNginx, EdgePKI, default_values, free_port, render
from gateway_process import GATED_ENGINE

pytestmark = pytest.mark.nginx


def _edge(edge_dir: Path, pki: EdgePKI, **overrides: str) -> EdgeNginx:
    # Nothing listens on the gateway address: the edge must answer on its own.
    values = default_values(edge_dir, pki.cert, pki.key, f"127.0.0.1:{free_port()}")
    values.update(overrides)
    return EdgeNginx(edge_dir, values)


@pytest.fixture
def edge(edge_dir: Path, test_pki: EdgePKI) -> Iterator[EdgeNginx]:
    nginx = _edge(edge_dir, test_pki)
    nginx.start()
    try:
        yield nginx
    finally:
        nginx.stop()


def _client_context(pki: EdgePKI) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    pki.ca.configure_trust(ctx)
    return ctx


def _handshake(port: int, ctx: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="localhost")


def test_rendered_template_passes_nginx_t(edge_dir: Path, test_pki: EdgePKI) -> None:
    result = _edge(edge_dir, test_pki).check()
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_t_rejects_a_bad_value(edge_dir: Path, test_pki: EdgePKI) -> None:
    result = _edge(edge_dir, test_pki, PORTICO_RATE_LIMIT="lots").check()
    assert result.returncode != 0
    assert "rate" in result.stderr


def test_render_refuses_a_missing_value() -> None:
    with pytest.raises(KeyError, match="PORTICO_TLS_CERT"):
        render(TEMPLATE.read_text(), {"PORTICO_HTTP_PORT": "80"})


@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"]
)
def test_tls_1_2_and_1_3_are_accepted(
    edge: EdgeNginx, test_pki: EdgePKI, version: ssl.TLSVersion
) -> None:
    ctx = _client_context(test_pki)
    ctx.minimum_version = ctx.maximum_version = version
    with _handshake(edge.https_port, ctx) as tls:
        assert tls.version() == {"TLSv1_2": "TLSv1.2", "TLSv1_3": "TLSv1.3"}[version.name]
        if version is ssl.TLSVersion.TLSv1_2:
            # modern suites only: ECDHE key exchange with an AEAD cipher
            name = tls.cipher()[0]
            assert name.startswith("ECDHE-") and ("GCM" in name or "CHACHA20" in name), name


def test_tls_1_1_is_refused(edge: EdgeNginx, test_pki: EdgePKI) -> None:
    ctx = _client_context(test_pki)
    ctx.set_ciphers("ALL:@SECLEVEL=0")  # let the client offer what the server must refuse
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    # the server's alert, not a client-side refusal (this client can speak TLS 1.1)
    with pytest.raises(ssl.SSLError, match="(?i)protocol.version"):
        _handshake(edge.https_port, ctx).close()


def test_certificate_from_an_unknown_ca_is_rejected_by_clients(edge: EdgeNginx) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(edge.https_port, ssl.create_default_context()).close()


def test_http2_is_negotiated(edge: EdgeNginx, test_pki: EdgePKI) -> None:
    ctx = _client_context(test_pki)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with _handshake(edge.https_port, ctx) as tls:
        assert tls.selected_alpn_protocol() == "h2"


def test_plain_http_redirects_to_https(edge: EdgeNginx) -> None:
    r = httpx.get(f"http://127.0.0.1:{edge.http_port}/v1/models?x=1", headers={"host": "localhost"})
    assert r.status_code == 308  # method-preserving: a POST is redirected as a POST
    assert r.headers["location"] == f"https://localhost:{edge.https_port}/v1/models?x=1"


def test_nginx_health_answers_on_both_ports(edge: EdgeNginx, test_pki: EdgePKI) -> None:
    assert httpx.get(f"http://127.0.0.1:{edge.http_port}/nginx-health").text == "ok\n"
    r = httpx.get(
        f"https://localhost:{edge.https_port}/nginx-health", verify=_client_context(test_pki)
    )
    assert r.status_code == 200


def _assert_openai_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    body = json.loads(r.text)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code


def test_no_gateway_is_a_503_in_openai_shape(edge: EdgeNginx, test_pki: EdgePKI) -> None:
    with httpx.Client(verify=_client_context(test_pki)) as client:
        r = client.post(f"https://localhost:{edge.https_port}/v1/chat/completions", json={})
    _assert_openai_error(r, 503, "no_healthy_upstream")
    assert r.headers["retry-after"] == "5"
    assert "connect() failed" in edge.error_log()


def test_oversized_body_is_refused_at_the_edge(edge_dir: Path, test_pki: EdgePKI) -> None:
    nginx = _edge(edge_dir, test_pki, PORTICO_CLIENT_MAX_BODY_SIZE="64k")
    nginx.start()
    try:
        with httpx.Client(verify=_client_context(test_pki)) as client:
            url = f"https://localhost:{nginx.https_port}/v1/chat/completions"
            r = client.post(url, content=b"x" * (65 * 1024))
    finally:
        nginx.stop()
    _assert_openai_error(r, 413, "request_too_large")


def test_server_header_hides_the_version_and_metrics_stay_private(
    edge: EdgeNginx, test_pki: EdgePKI
) -> None:
    with httpx.Client(verify=_client_context(test_pki)) as client:
        r = client.get(f"https://localhost:{edge.https_port}/metrics")
    assert r.status_code == 404
    assert r.headers["server"] == "nginx"
    assert r.headers["strict-transport-security"].startswith("max-age=")


def test_a_caller_request_id_is_kept_and_a_missing_one_is_minted(
    edge: EdgeNginx, test_pki: EdgePKI
) -> None:
    with httpx.Client(verify=_client_context(test_pki)) as client:
        url = f"https://localhost:{edge.https_port}/v1/models"
        kept = client.get(url, headers={"x-request-id": "caller-id-1"})
        minted = client.get(url)
        odd = client.get(url, headers={"x-request-id": "two words"})
        too_long = client.get(url, headers={"x-request-id": "a" * 129})
    assert kept.headers["x-request-id"] == "caller-id-1"
    for r in (minted, odd, too_long):
        assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])


@pytest.fixture
def gated_engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The gated engine on a loopback port (address, gate folder), for nginx alone."""
    port = free_port()
    gates = tmp_path / "gates"
    gates.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(GATED_ENGINE), "--port", str(port), "--gate-dir", str(gates)],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gated engine did not start") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}", gates
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_nginx_alone_relays_sse_unbuffered(
    edge_dir: Path, test_pki: EdgePKI, gated_engine: tuple[str, Path]
) -> None:
    # The gateway marks its streams `x-accel-buffering: no`; this upstream does not, so only
    # the edge config's own `proxy_buffering off` keeps "first" from waiting in nginx until
    # the upstream has finished (it finishes only once this client has seen "first").
    address, gates = gated_engine
    nginx = _edge(edge_dir, test_pki)
    nginx.values["PORTICO_GATEWAY_ADDR"] = address
    nginx.start()
    gate = "gate-" + secrets.token_hex(6)
    body = {"model": "gated", "messages": [], "stream": True, "gate": gate}
    words = []
    try:
        with httpx.Client(verify=_client_context(test_pki), timeout=120) as client:
            url = f"https://localhost:{nginx.https_port}/v1/chat/completions"
            with client.stream("POST", url, json=body) as r:
                assert r.headers.get("x-accel-buffering") is None
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        words.append(delta["content"])
                        if len(words) == 1:
                            (gates / gate).touch()
    finally:
        nginx.stop()
    assert words[0] == "first"
    assert words[1].startswith(" released")


def test_dev_certificate_script_makes_a_pair_nginx_serves(edge_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "make-dev-cert.sh"
    script.write_bytes((REPO_ROOT / "deploy/compose/make-dev-cert.sh").read_bytes())
    script.chmod(0o755)
    made = subprocess.run([str(script), "llm.test"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    cert, key = tmp_path / "certs/fullchain.pem", tmp_path / "certs/privkey.pem"
    nginx = EdgeNginx(edge_dir, default_values(edge_dir, cert, key, f"127.0.0.1:{free_port()}"))
    nginx.start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert))  # self-signed: it is its own CA
        with _handshake(nginx.https_port, ctx) as tls:
            assert tls.getpeercert()["subjectAltName"] == (
                ("DNS", "llm.test"),
                ("DNS", "localhost"),
                ("IP Address", "127.0.0.1"),
            )
    finally:
        nginx.stop()
