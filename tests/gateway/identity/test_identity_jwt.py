"""JWT authentication through HTTP: every attack is a 401 in OpenAI's shape; keys come from a
PEM file or from a JWKS served by a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from identity_app import assert_openai_error, bearer, build_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.identity.auth import AuthSettings, Identity, open_identity
from gateway.identity.jwt_auth import JWKSCache, JWTSettings
from gateway.store import SharedRedis, StoreSettings, open_shared_redis

ISSUER = "https://idp.example"
AUDIENCE = "portico"
HMAC_SECRET = "h" * 48

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RSA_KEY_2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())


def _public_pem(key: Any) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _jwk(key: Any, kid: str, alg: str) -> dict[str, Any]:
    algo = jwt.algorithms.RSAAlgorithm if alg.startswith("RS") else jwt.algorithms.ECAlgorithm
    data = json.loads(algo.to_jwk(key.public_key()))
    return {**data, "kid": kid, "alg": alg, "use": "sig"}


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    body = {
        "iss": ISSUER,
        "aud": AUDIENCE,
        "sub": "alice",
        "tenant": "acme",
        "iat": now,
        "exp": now + 600,
        "scope": "inference models:read",
    }
    body.update(overrides)
    return {k: v for k, v in body.items() if v is not None}


def sign(
    body: dict[str, Any],
    key: Any = RSA_KEY,
    alg: str = "RS256",
    headers: dict[str, Any] | None = None,
) -> str:
    return jwt.encode(body, key, algorithm=alg, headers=headers)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge_hs256(body: dict[str, Any], secret: bytes) -> str:
    """HS256 by hand (PyJWT rightly refuses to sign with a PEM key): the classic key-confusion
    attack, using the server's RSA *public* key as the HMAC secret."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    signing_input = f"{header}.{_b64(json.dumps(body).encode())}"
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_b64(mac)}"


def unsigned(body: dict[str, Any], alg: str = "none") -> str:
    header = _b64(json.dumps({"alg": alg, "typ": "JWT"}).encode())
    return f"{header}.{_b64(json.dumps(body).encode())}."


class JWKSServer:
    """A real HTTP server (uvicorn, 127.0.0.1, ephemeral port) serving a mutable JWKS."""

    def __init__(self) -> None:
        self.jwks: dict[str, Any] = {"keys": []}
        self.hits = 0

        async def serve(request: Request) -> JSONResponse:
            self.hits += 1
            return JSONResponse(self.jwks)

        app = Starlette(routes=[Route("/.well-known/jwks.json", serve)])
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/.well-known/jwks.json"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        for _ in range(1000):
            if self.server.started:
                return
            time.sleep(0.01)
        raise RuntimeError("JWKS server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def jwks_server() -> Iterator[JWKSServer]:
    server = JWKSServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pem_file(tmp_path: Path) -> Path:
    path = tmp_path / "idp.pem"
    path.write_bytes(_public_pem(RSA_KEY))
    return path


async def _identity(
    redis_url: str, tmp_path: Path, jwt_settings: JWTSettings
) -> tuple[SharedRedis, Identity]:
    env = {"PORTICO_ADMIN_KEY": "adm-" + "k" * 40, "PORTICO_JWT_HMAC_SECRET": HMAC_SECRET}
    settings = StoreSettings(url=redis_url, data_dir=tmp_path / "data")
    redis = await open_shared_redis(settings, env)
    ident = open_identity(redis.client, settings, AuthSettings(jwt=jwt_settings), env)
    from gateway.identity.records import TenantCreate, TenantPatch

    await ident.store.create_tenant(TenantCreate(id="acme", name="Acme", plan="standard"))
    await ident.store.create_tenant(TenantCreate(id="off", name="Off"))
    await ident.store.update_tenant("off", TenantPatch(disabled=True))
    return redis, ident


@pytest.fixture
async def make_client(redis_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Builds test apps with the given JWT settings; closes them all at the end."""
    opened: list[tuple[SharedRedis, Identity, httpx.AsyncClient]] = []

    async def make(**settings: Any) -> httpx.AsyncClient:
        base = {
            "issuer": ISSUER,
            "audience": [AUDIENCE],
            "max_lifetime_seconds": 3600,
            "leeway_seconds": 5,
        }
        redis, ident = await _identity(redis_url, tmp_path, JWTSettings(**{**base, **settings}))
        c = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(ident.authenticator)), base_url="http://gw"
        )
        c.identity = ident  # type: ignore[attr-defined]
        opened.append((redis, ident, c))
        return c

    yield make
    for redis, ident, c in opened:
        await c.aclose()
        await ident.aclose()
        await redis.aclose()


@pytest.fixture
async def pem_client(make_client, pem_file: Path) -> httpx.AsyncClient:
    return await make_client(algorithms=["RS256", "HS256"], public_key_file=pem_file)


@pytest.fixture
async def jwks_client(make_client, jwks_server: JWKSServer) -> httpx.AsyncClient:
    jwks_server.jwks = {"keys": [_jwk(RSA_KEY, "k1", "RS256"), _jwk(EC_KEY, "e1", "ES256")]}
    return await make_client(
        algorithms=["RS256", "ES256"], jwks_url=jwks_server.url, jwks_refresh_cooldown_seconds=3600
    )


async def test_valid_tokens_resolve_the_tenant(pem_client: httpx.AsyncClient) -> None:
    resp = await pem_client.get("/v1/whoami", headers=bearer(sign(claims())))
    assert resp.status_code == 200, resp.text
    me = resp.json()
    assert me["tenant_id"] == "acme" and me["subject"] == "alice" and me["key_id"] is None
    assert me["plan"] == "standard" and me["scopes"] == ["inference", "models:read"]
    hs = sign(claims(), HMAC_SECRET, "HS256")
    assert (await pem_client.get("/v1/whoami", headers=bearer(hs))).status_code == 200


ATTACKS: dict[str, Callable[[], str]] = {
    "alg_none": lambda: unsigned(claims()),
    "alg_none_uppercase": lambda: unsigned(claims(), alg="None"),
    "hs256_signed_with_rsa_public_key": lambda: forge_hs256(claims(), _public_pem(RSA_KEY)),
    "expired": lambda: sign(claims(iat=int(time.time()) - 1200, exp=int(time.time()) - 600)),
    "wrong_audience": lambda: sign(claims(aud="someone-else")),
    "wrong_issuer": lambda: sign(claims(iss="https://evil.example")),
    "missing_exp": lambda: sign(claims(exp=None)),
    "missing_iat": lambda: sign(claims(iat=None)),
    "missing_iss": lambda: sign(claims(iss=None)),
    "missing_aud": lambda: sign(claims(aud=None)),
    "lifetime_above_cap": lambda: sign(claims(exp=int(time.time()) + 7200)),
    "crit_header": lambda: sign(claims(), headers={"crit": ["exp"], "exp": 1}),
    "crit_unknown_extension": lambda: sign(
        claims(), headers={"crit": ["x-portico"], "x-portico": 1}
    ),
    "tampered_payload": lambda: _tamper(sign(claims())),
    "signed_by_another_key": lambda: sign(claims(), RSA_KEY_2),
    "alg_not_configured": lambda: sign(claims(), RSA_KEY, "RS512"),
    "missing_tenant_claim": lambda: sign(claims(tenant=None)),
    "unknown_tenant": lambda: sign(claims(tenant="nobody")),
    "tenant_claim_not_a_string": lambda: sign(claims(tenant=["acme"])),
    "not_yet_valid": lambda: sign(claims(nbf=int(time.time()) + 600)),
    "garbage": lambda: "aaa.bbb.ccc",
}


def _tamper(token: str) -> str:
    header, payload, sig = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    body["tenant"] = "other"
    return f"{header}.{_b64(json.dumps(body).encode())}.{sig}"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_jwt_attacks_are_401(pem_client: httpx.AsyncClient, attack: str) -> None:
    token = ATTACKS[attack]()
    err = assert_openai_error(await pem_client.get("/v1/whoami", headers=bearer(token)), 401)
    assert err["type"] == "authentication_error"
    assert token not in json.dumps(err)
    # none of them opens the admin API either (a well-formed token without the admin role,
    # like the one missing its tenant claim, is 403 there)
    resp = await pem_client.get("/admin/v1/tenants", headers=bearer(token))
    assert resp.status_code in (401, 403)


async def test_disabled_tenant_token_is_refused(pem_client: httpx.AsyncClient) -> None:
    resp = await pem_client.get("/v1/whoami", headers=bearer(sign(claims(tenant="off"))))
    assert assert_openai_error(resp, 403)["code"] == "tenant_disabled"


async def test_rsa_only_config_refuses_hs256_with_the_public_key(
    make_client, pem_file: Path
) -> None:
    c = await make_client(algorithms=["RS256"], public_key_file=pem_file)
    forged = forge_hs256(claims(), _public_pem(RSA_KEY))
    assert_openai_error(await c.get("/v1/whoami", headers=bearer(forged)), 401)


async def test_admin_role_token_opens_the_admin_api(pem_client: httpx.AsyncClient) -> None:
    admin = sign(claims(tenant=None, roles=["portico:admin"], sub="ops"))
    resp = await pem_client.get("/admin/v1/tenants", headers=bearer(admin))
    assert resp.status_code == 200, resp.text
    assert {t["id"] for t in resp.json()["data"]} == {"acme", "off"}
    resp = await pem_client.post(
        "/admin/v1/tenants", headers=bearer(admin), json={"id": "new", "name": "New"}
    )
    assert resp.status_code == 201
    # The audit log names the token's subject as the one who made the change.
    entry = (await pem_client.get("/admin/v1/audit", headers=bearer(admin))).json()["data"][0]
    assert (entry["actor"], entry["actor_kind"], entry["action"]) == ("ops", "jwt", "tenant.create")
    # Without the role a valid tenant token is 403 at /admin.
    user = sign(claims(roles=["reader"]))
    err = assert_openai_error(await pem_client.get("/admin/v1/tenants", headers=bearer(user)), 403)
    assert err["type"] == "permission_error"
    # An expired admin token is 401.
    expired = sign(
        claims(roles=["portico:admin"], iat=int(time.time()) - 1200, exp=int(time.time()) - 600)
    )
    assert_openai_error(await pem_client.get("/admin/v1/tenants", headers=bearer(expired)), 401)


async def test_jwks_selects_keys_by_kid(
    jwks_client: httpx.AsyncClient, jwks_server: JWKSServer
) -> None:
    for key, kid, alg in ((RSA_KEY, "k1", "RS256"), (EC_KEY, "e1", "ES256")):
        token = sign(claims(), key, alg, headers={"kid": kid})
        resp = await jwks_client.get("/v1/whoami", headers=bearer(token))
        assert resp.status_code == 200, resp.text
    assert jwks_client.identity.authenticator.jwt.jwks.num_fetches == 1


@pytest.mark.parametrize(
    "case", ["unknown_kid", "missing_kid", "kid_of_other_family", "kid_declares_other_alg"]
)
async def test_jwks_attacks_are_401(
    jwks_client: httpx.AsyncClient, jwks_server: JWKSServer, case: str
) -> None:
    token = {
        "unknown_kid": lambda: sign(claims(), RSA_KEY_2, headers={"kid": "nope"}),
        "missing_kid": lambda: sign(claims(), RSA_KEY),
        # An RS256 header pointing at the EC key: the key type must match the algorithm.
        "kid_of_other_family": lambda: sign(claims(), RSA_KEY, headers={"kid": "e1"}),
        "kid_declares_other_alg": lambda: sign(claims(), EC_KEY, "ES256", headers={"kid": "k1"}),
    }[case]()
    assert_openai_error(await jwks_client.get("/v1/whoami", headers=bearer(token)), 401)


async def test_unknown_kids_do_not_hammer_the_idp(
    jwks_client: httpx.AsyncClient, jwks_server: JWKSServer
) -> None:
    ok = sign(claims(), RSA_KEY, headers={"kid": "k1"})
    assert (await jwks_client.get("/v1/whoami", headers=bearer(ok))).status_code == 200
    hits = jwks_server.hits
    for i in range(20):
        token = sign(claims(), RSA_KEY_2, headers={"kid": f"unknown-{i}"})
        assert_openai_error(await jwks_client.get("/v1/whoami", headers=bearer(token)), 401)
    assert jwks_server.hits == hits  # inside the cool-down: no fetch at all


async def test_unknown_kid_refreshes_at_most_once_per_cooldown(jwks_server: JWKSServer) -> None:
    jwks_server.jwks = {"keys": [_jwk(RSA_KEY, "k1", "RS256")]}
    clock = FakeClock(0.0)
    cache = JWKSCache(
        jwks_server.url, cache_seconds=300, cooldown_seconds=30, timeout_seconds=5, clock=clock
    )
    try:
        assert await cache.get("k1") is not None and cache.num_fetches == 1
        for _ in range(5):
            assert await cache.get("unknown") is None
        assert cache.num_fetches == 1
        clock.now = 31.0
        for _ in range(5):
            assert await cache.get("unknown") is None
        assert cache.num_fetches == 2
        jwks_server.jwks = {"keys": [_jwk(RSA_KEY, "k1", "RS256"), _jwk(RSA_KEY_2, "k2", "RS256")]}
        assert await cache.get("k2") is None  # published, but we are inside the cool-down
        clock.now = 62.0
        assert await cache.get("k2") is not None and cache.num_fetches == 3
        clock.now = 400.0  # the whole set is stale: refreshed on the next lookup
        assert await cache.get("k1") is not None and cache.num_fetches == 4
    finally:
        await cache.aclose()


async def test_key_rotation_at_the_idp_is_picked_up_by_kid(
    make_client, jwks_server: JWKSServer
) -> None:
    jwks_server.jwks = {"keys": [_jwk(RSA_KEY, "k1", "RS256")]}
    c = await make_client(
        algorithms=["RS256"], jwks_url=jwks_server.url, jwks_refresh_cooldown_seconds=0
    )
    old = sign(claims(), RSA_KEY, headers={"kid": "k1"})
    assert (await c.get("/v1/whoami", headers=bearer(old))).status_code == 200
    jwks_server.jwks = {"keys": [_jwk(RSA_KEY_2, "k2", "RS256")]}
    new = sign(claims(), RSA_KEY_2, headers={"kid": "k2"})
    assert (await c.get("/v1/whoami", headers=bearer(new))).status_code == 200
    # k1 left the set: after the refresh it is unknown.
    assert_openai_error(await c.get("/v1/whoami", headers=bearer(old)), 401)


async def test_unreachable_jwks_refuses_cleanly(make_client, jwks_server: JWKSServer) -> None:
    c = await make_client(
        algorithms=["RS256"], jwks_url="http://127.0.0.1:9/jwks.json", jwks_timeout_seconds=2
    )
    token = sign(claims(), RSA_KEY, headers={"kid": "k1"})
    assert_openai_error(await c.get("/v1/whoami", headers=bearer(token)), 401)


@pytest.mark.parametrize(
    "bad",
    [
        {"algorithms": ["none"]},
        {"algorithms": []},
        {"algorithms": ["RS256"]},  # no key source
        {"algorithms": ["RS256"], "jwks_url": "file:///etc/passwd"},
        {"audience": []},
        {"algorithms": ["HS256"], "leeway_seconds": -1},
    ],
)
def test_bad_jwt_settings_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        JWTSettings(**{"issuer": ISSUER, "audience": [AUDIENCE], **bad})


async def test_short_hmac_secret_is_refused(redis_url: str, tmp_path: Path) -> None:
    settings = AuthSettings(
        jwt=JWTSettings(issuer=ISSUER, audience=[AUDIENCE], algorithms=["HS256"])
    )
    store = StoreSettings(url=redis_url, data_dir=tmp_path)
    redis = await open_shared_redis(store, {})
    try:
        with pytest.raises(ValueError, match="at least"):
            open_identity(redis.client, store, settings, {"PORTICO_JWT_HMAC_SECRET": "short"})
    finally:
        await redis.aclose()
