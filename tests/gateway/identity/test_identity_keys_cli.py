"""``portico keys`` end to end: the real CLI (portico.cli.main) against the admin API served by
uvicorn on 127.0.0.1, over the embedded Redis."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from identity_app import ADMIN_KEY, build_app
from starlette.routing import Mount

from gateway.identity.auth import AuthSettings, open_identity
from gateway.store import StoreSettings, open_shared_redis
from portico.cli import main


class Gateway:
    """The identity test app served by uvicorn in a thread; Redis opened in its lifespan."""

    def __init__(self, data_dir: Path, **tls: object) -> None:
        self.data_dir = data_dir
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.sock.getsockname()[1]}"
        self.identity = None

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            settings, env = StoreSettings(data_dir=data_dir), {"PORTICO_ADMIN_KEY": ADMIN_KEY}
            redis = await open_shared_redis(settings, env)
            ident = open_identity(redis.client, settings, AuthSettings(), env)
            self.identity = ident
            # The app's middleware stack is already built: mount the test app whole.
            app.router.routes.append(Mount("/", app=build_app(ident.authenticator)))
            yield
            await ident.aclose()
            await redis.aclose()

        app = FastAPI(lifespan=lifespan)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **tls))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        for _ in range(2000):
            if self.server.started:
                return
            time.sleep(0.01)
        raise RuntimeError("gateway did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path / "data")
    gw.start()
    yield gw
    gw.stop()


def keys(gw: Gateway, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["keys", "--url", gw.url, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_manages_tenants_and_keys(
    gateway: Gateway,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("PORTICO_ADMIN_KEY", ADMIN_KEY)
    code, out, _ = keys(
        gateway, capsys, "tenants", "create", "acme", "--plan", "standard", "--rpm", "99"
    )
    assert code == 0 and json.loads(out)["effective"]["limits"]["requests_per_minute"] == 99
    code, out, _ = keys(gateway, capsys, "tenants", "list")
    assert [t["id"] for t in json.loads(out)["data"]] == ["acme"]

    code, out, err = keys(gateway, capsys, "create", "acme", "--name", "ci")
    created = json.loads(out)
    secret = created["key"]
    assert code == 0 and secret.startswith("sk-") and "not be shown again" in err
    who = httpx.get(f"{gateway.url}/v1/whoami", headers={"Authorization": f"Bearer {secret}"})
    assert who.status_code == 200 and who.json()["tenant_id"] == "acme"

    code, out, _ = keys(gateway, capsys, "list", "acme")
    listed = json.loads(out)["data"]
    assert [k["id"] for k in listed] == [created["id"]] and secret not in out

    code, out, _ = keys(gateway, capsys, "rotate", "acme", created["id"])
    rotated = json.loads(out)
    assert code == 0 and rotated["key"] != secret
    code, out, _ = keys(gateway, capsys, "revoke", "acme", rotated["id"])
    assert code == 0 and json.loads(out)["status"] == "revoked"
    who = httpx.get(
        f"{gateway.url}/v1/whoami", headers={"Authorization": f"Bearer {rotated['key']}"}
    )
    assert who.status_code == 401

    code, out, _ = keys(gateway, capsys, "tenants", "update", "acme", "--disable")
    assert code == 0 and json.loads(out)["disabled"] is True
    code, out, _ = keys(
        gateway, capsys, "usage", "acme", "--start", "2020-01-01", "--end", "2020-01-02"
    )
    assert code == 0 and json.loads(out)["totals"]["requests"] == 0
    code, out, _ = keys(gateway, capsys, "plans")
    assert code == 0 and json.loads(out)["default"] == "free"

    # The admin key from a file works too, and the environment is not needed.
    monkeypatch.delenv("PORTICO_ADMIN_KEY")
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    code, out, _ = keys(
        gateway, capsys, "--admin-key-file", str(key_file), "tenants", "show", "acme"
    )
    assert code == 0 and json.loads(out)["id"] == "acme"
    code, out, _ = keys(
        gateway, capsys, "--admin-key-file", str(key_file), "tenants", "delete", "acme"
    )
    assert code == 0 and out == ""


def test_cli_falls_back_to_the_admin_key_portico_serve_generated_in_this_folder(
    gateway: Gateway,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # `portico serve` with no admin key configured writes one to .portico/admin_key (its
    # default data dir); the README then runs `portico keys ...` from the same folder.
    monkeypatch.delenv("PORTICO_ADMIN_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".portico").mkdir()
    (tmp_path / ".portico" / "admin_key").write_text(ADMIN_KEY + "\n")
    code, out, err = keys(gateway, capsys, "plans")
    assert code == 0, err
    assert json.loads(out)["default"] == "free"


def test_keys_help_and_rotate_help_agree_on_the_grace_period(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["keys", "--help"])
    overview = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["keys", "rotate", "--help"])
    rotate = " ".join(capsys.readouterr().out.split())
    assert "--grace" in rotate and "--grace" in overview
    assert "revoked" not in overview  # the old secret lives on for --grace seconds


def test_cli_reports_errors(
    gateway: Gateway,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv("PORTICO_ADMIN_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # no .portico/admin_key here
    code, _, err = keys(gateway, capsys, "tenants", "list")
    assert code == 2 and "no admin key" in err
    code, _, err = keys(gateway, capsys, "--admin-key", "wrong-admin-key-123", "tenants", "list")
    assert code == 1 and "401" in err and "wrong-admin-key-123" not in err
    code, _, err = keys(gateway, capsys, "--admin-key", ADMIN_KEY, "list", "nobody")
    assert code == 1 and "404" in err
    code, _, err = keys(
        gateway, capsys, "--admin-key", ADMIN_KEY, "tenants", "create", "x", "--plan", "platinum"
    )
    assert code == 1 and "Unknown plan" in err
    # A path-like id stays one path segment (404), never another admin route.
    code, _, err = keys(gateway, capsys, "--admin-key", ADMIN_KEY, "list", "../../plans")
    assert code == 1
    code = main(["keys", "--url", "http://127.0.0.1:9", "--admin-key", ADMIN_KEY, "plans"])
    assert code == 1 and "cannot reach" in capsys.readouterr().err


def test_cli_over_tls_with_a_client_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """https with a private CA, and a gateway that requires a client certificate."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("portico-admin")
    ca_file, server_pem, client_pem = (tmp_path / n for n in ("ca.pem", "srv.pem", "cli.pem"))
    ca.cert_pem.write_to_path(str(ca_file))
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(server_pem))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(client_pem))
    gw = Gateway(
        tmp_path / "data",
        ssl_certfile=str(server_pem),
        ssl_ca_certs=str(ca_file),
        ssl_cert_reqs=ssl.CERT_REQUIRED,
    )
    gw.start()
    try:
        base = ["--admin-key", ADMIN_KEY, "--ca-file", str(ca_file)]
        code, out, _ = keys(gw, capsys, *base, "--client-cert", str(client_pem), "plans")
        assert code == 0 and json.loads(out)["default"] == "free"
        code, _, err = keys(gw, capsys, *base, "plans")  # no client certificate
        assert code == 1 and "cannot reach" in err
        code, _, err = keys(gw, capsys, "--admin-key", ADMIN_KEY, "plans")  # unknown CA
        assert code == 1 and "cannot reach" in err
    finally:
        gw.stop()


def test_cli_sets_money_budgets_on_tenants_and_keys_and_manages_prices(
    gateway: Gateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PORTICO_ADMIN_KEY", ADMIN_KEY)
    code, out, err = keys(gateway, capsys, "tenants", "create", "acme", "--budget-usd", "12.5")
    assert code == 0, err
    limits = json.loads(out)["effective"]["limits"]
    assert (limits["budget_usd"], limits["budget_period"]) == (12.5, None)  # None: monthly
    code, out, err = keys(
        gateway, capsys, "tenants", "update", "acme", "--budget-usd", "3", "--budget-period",
        "daily",
    )  # fmt: skip
    assert code == 0, err
    limits = json.loads(out)["effective"]["limits"]
    assert (limits["budget_usd"], limits["budget_period"]) == (3.0, "daily")
    code, out, err = keys(gateway, capsys, "create", "acme", "--budget-usd", "0.25", "--rpm", "7")
    assert code == 0, err
    key_id = json.loads(out)["id"]
    # what the key got, as the admin API stores it
    shown = httpx.get(
        f"{gateway.url}/admin/v1/tenants/acme/keys/{key_id}",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ).json()
    assert shown["limits"]["budget_usd"] == 0.25 and shown["limits"]["requests_per_minute"] == 7
    code, _, err = keys(gateway, capsys, "tenants", "update", "acme", "--budget-usd", "-1")
    assert code == 1 and "400" in err and "budget_usd" in err
    with pytest.raises(SystemExit) as exited:  # argparse refuses a period it does not know
        keys(gateway, capsys, "tenants", "update", "acme", "--budget-period", "weekly")
    assert exited.value.code == 2 and "invalid choice: 'weekly'" in capsys.readouterr().err

    code, out, err = keys(
        gateway, capsys, "prices", "set", "openai/gpt-4o", "--input", "2.5", "--output", "10"
    )
    assert code == 0, err
    price = json.loads(out)
    assert (price["model"], price["input"], price["output"]) == ("openai/gpt-4o", 2.5, 10.0)
    assert price["source"] == "admin"
    code, out, _ = keys(gateway, capsys, "prices", "list")
    assert [p["model"] for p in json.loads(out)["data"]] == ["openai/gpt-4o"]
    code, out, _ = keys(gateway, capsys, "prices", "show", "openai/gpt-4o")
    assert code == 0 and json.loads(out)["cached_input"] == 2.5  # defaults to the input price
    code, out, _ = keys(gateway, capsys, "prices", "delete", "openai/gpt-4o")
    assert code == 0 and out == ""
    code, _, err = keys(gateway, capsys, "prices", "show", "openai/gpt-4o")
    assert code == 1 and "404" in err
    code, _, err = keys(gateway, capsys, "prices", "set", "m", "--input", "-1", "--output", "1")
    assert code == 1 and "400" in err and "input" in err
