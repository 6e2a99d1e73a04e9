"""The console's security over plain HTTP against a real ``portico serve`` (fake engine):
sign-in, the session cookie's attributes, CSRF on every change, a cookie-less change refused,
the Content-Security-Policy, sign-out, and the audit entry naming the request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, fake_engine_command


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("console-http")
    config = {
        "engines": [
            {"name": "fake", "command": fake_engine_command(), "count_tokens_with": "estimate"}
        ]
    }
    gw = GatewayProcess(workdir, config, routing={})
    gw.start(timeout=120)
    yield gw
    gw.terminate()


def sign_in(gateway: GatewayProcess) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=gateway.base_url, timeout=10)
    resp = client.post("/admin/ui/session", json={"credential": ADMIN_KEY})
    assert resp.status_code == 200, resp.text
    return client, resp.json()["csrf_token"]


def test_sign_in_sets_a_strict_http_only_cookie(gateway: GatewayProcess) -> None:
    resp = httpx.post(gateway.base_url + "/admin/ui/session", json={"credential": ADMIN_KEY})
    assert resp.status_code == 200, resp.text
    cookie = resp.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert {"httponly", "samesite", "path"} <= attributes
    assert "samesite=strict" in cookie.lower() and "path=/admin" in cookie.lower()
    assert "secure" not in attributes  # plain HTTP here; Secure when the gateway serves TLS
    body = resp.json()
    assert body["actor"].startswith("admin-") and len(body["csrf_token"]) >= 32
    assert ADMIN_KEY not in resp.text and ADMIN_KEY not in cookie

    wrong = httpx.post(gateway.base_url + "/admin/ui/session", json={"credential": "x" * 40})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"]
    assert "set-cookie" not in wrong.headers
    # A form post (what a cross-site page can send without CORS) is refused.
    form = httpx.post(gateway.base_url + "/admin/ui/session", data={"credential": ADMIN_KEY})
    assert form.status_code == 400 and "set-cookie" not in form.headers


def test_changes_need_the_csrf_token_and_the_cookie(gateway: GatewayProcess) -> None:
    client, csrf = sign_in(gateway)
    try:
        # Reads with the session alone.
        assert client.get("/admin/v1/tenants").status_code == 200
        # A change without the CSRF token, or with a wrong one: 403, nothing made.
        body = {"id": "csrf-victim", "name": "x"}
        resp = client.post("/admin/v1/tenants", json=body)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "csrf_token_invalid"
        resp = client.post("/admin/v1/tenants", json=body, headers={"x-csrf-token": "f" * 43})
        assert resp.status_code == 403
        assert client.get("/admin/v1/tenants/csrf-victim").status_code == 404
        # A cookie-less change, even with the right CSRF token: 401.
        bare = httpx.post(
            gateway.base_url + "/admin/v1/tenants", json=body, headers={"x-csrf-token": csrf}
        )
        assert bare.status_code == 401
        assert client.get("/admin/v1/tenants/csrf-victim").status_code == 404
        # With both, it works, and the audit names the session's actor, address and request.
        resp = client.post(
            "/admin/v1/tenants",
            json={"id": "console-made", "name": "x"},
            headers={"x-csrf-token": csrf, "x-request-id": "console-req-1"},
        )
        assert resp.status_code == 201, resp.text
        entry = client.get("/admin/v1/audit", params={"action": "tenant.create"}).json()["data"][0]
        assert entry["target"] == "tenant:console-made" and entry["actor"].startswith("admin-")
        assert entry["address"] == "127.0.0.1" and entry["request_id"] == "console-req-1"
        # The engines page's data, through the same session.
        engines = client.get("/admin/v1/engines").json()["data"]
        assert [(e["name"], e["state"], e["up"]) for e in engines] == [("fake-0", "ready", True)]
        # Sign-out needs the token too, then the session is gone.
        assert client.delete("/admin/ui/session").status_code == 403
        assert client.delete("/admin/ui/session", headers={"x-csrf-token": csrf}).status_code == 204
        assert client.get("/admin/v1/tenants").status_code == 401
        resp = client.post("/admin/v1/tenants", json=body, headers={"x-csrf-token": csrf})
        assert resp.status_code == 401
    finally:
        client.close()


def test_console_is_served_with_a_strict_csp(gateway: GatewayProcess) -> None:
    page = httpx.get(gateway.base_url + "/admin/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-frame-options"] == "DENY" and "frame-ancestors 'none'" in csp
    assert "<script>" not in page.text and " style=" not in page.text  # nothing inline
    for name, kind in (("console.js", "javascript"), ("console.css", "css")):
        resp = httpx.get(f"{gateway.base_url}/admin/ui/static/{name}")
        assert resp.status_code == 200 and kind in resp.headers["content-type"]
        assert resp.headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(gateway.base_url + "/admin/ui/static/../app.py")
    assert missing.status_code == 404
    assert httpx.get(gateway.base_url + "/admin/ui/session").status_code == 401


def test_console_files_ship_in_the_package() -> None:
    import gateway.console.routes as routes

    for name in ("index.html", *routes.STATIC_FILES):
        assert (routes.STATIC_DIR / name).is_file()
    assert Path(routes.__file__).parent.name == "console"
