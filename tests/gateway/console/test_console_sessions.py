"""Console sessions over a real Redis: admin key and admin JWT sign-in, expiry (capped by the
JWT's ``exp``), a replaced admin key ending its sessions, and the admin check of a request
(bearer first; else the cookie, with the CSRF token on every change)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from fastapi import FastAPI
from starlette.requests import Request

from gateway.console.routes import build_console_router
from gateway.console.sessions import COOKIE_NAME, ConsoleSessions, ConsoleSettings
from gateway.identity.audit import AuditLog
from gateway.identity.auth import AuthSettings, Identity, JWTSettings, open_identity
from gateway.store import StoreSettings, open_shared_redis
from portico.errors import AuthenticationError, PermissionDeniedError
from portico.http_errors import install_error_handlers

ADMIN_KEY = "adm-" + "c" * 40
KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def token(**claims: Any) -> str:
    now = int(time.time())
    body = {"iss": "https://idp", "aud": "portico", "sub": "ops", "iat": now, "exp": now + 600}
    body.update(claims)
    return jwt.encode(body, KEY, algorithm="RS256")


def pem_file(folder: Path) -> Path:
    """The IdP's public key, where the JWT settings read it."""
    folder.mkdir(parents=True, exist_ok=True)
    pem = folder / "idp.pem"
    public = KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    pem.write_bytes(public)
    return pem


async def open_ident(redis_url: str, tmp_path: Path, admin_key: str) -> tuple[Any, Identity]:
    pem = pem_file(tmp_path)
    settings = StoreSettings(url=redis_url, data_dir=tmp_path / "data")
    env = {"PORTICO_ADMIN_KEY": admin_key}
    redis = await open_shared_redis(settings, env)
    jwt_settings = JWTSettings(
        issuer="https://idp", audience=["portico"], algorithms=["RS256"], public_key_file=pem
    )
    return redis, open_identity(redis.client, settings, AuthSettings(jwt=jwt_settings), env)


@pytest.fixture
async def identity(redis_url: str, tmp_path: Path) -> AsyncIterator[Identity]:
    redis, ident = await open_ident(redis_url, tmp_path, ADMIN_KEY)
    yield ident
    await ident.aclose()
    await redis.aclose()


def request(
    method: str, session_id: str | None, csrf: str | None = None, auth: str | None = None
) -> Request:
    headers = []
    if session_id is not None:
        headers.append((b"cookie", f"{COOKIE_NAME}={session_id}".encode()))
    if csrf is not None:
        headers.append((b"x-csrf-token", csrf.encode()))
    if auth is not None:
        headers.append((b"authorization", auth.encode()))
    scope = {"type": "http", "method": method, "path": "/admin/v1/tenants", "headers": headers,
             "query_string": b"", "client": ("10.1.2.3", 5000)}  # fmt: skip
    return Request(scope)


async def test_admin_key_session_and_csrf(identity: Identity) -> None:
    sessions = ConsoleSessions(identity.redis, identity.authenticator)
    session_id, session = await sessions.sign_in(ADMIN_KEY)
    assert session.kind == "admin_key" and session.actor == identity.authenticator.admin_key_id
    # Reads need only the cookie; changes need the CSRF token too.
    principal = await sessions.resolve_admin(request("GET", session_id))
    assert principal.is_admin and principal.key_id == session.actor
    with pytest.raises(PermissionDeniedError):
        await sessions.resolve_admin(request("POST", session_id))
    with pytest.raises(PermissionDeniedError):
        await sessions.resolve_admin(request("DELETE", session_id, csrf="wrong"))
    assert (await sessions.resolve_admin(request("PATCH", session_id, session.csrf_token))).is_admin
    # A bearer header is checked as before, whatever the cookie says.
    with pytest.raises(AuthenticationError):
        await sessions.resolve_admin(request("POST", session_id, session.csrf_token, "Bearer nope"))
    # Nothing at all: 401; an unknown session id: 401.
    with pytest.raises(AuthenticationError):
        await sessions.resolve_admin(request("POST", None))
    with pytest.raises(AuthenticationError):
        await sessions.resolve_admin(request("GET", "not-a-session"))
    # Only a hash of the session id is stored.
    keys = [k.decode() for k in await identity.redis.keys("portico:console_session:*")]
    assert len(keys) == 1 and session_id not in keys[0]
    await sessions.sign_out(session_id)
    assert await sessions.find(session_id) is None


async def test_wrong_credentials_make_no_session(identity: Identity) -> None:
    sessions = ConsoleSessions(identity.redis, identity.authenticator)
    with pytest.raises(AuthenticationError):
        await sessions.sign_in("x" * 40)
    with pytest.raises(PermissionDeniedError):  # a valid JWT without the admin role
        await sessions.sign_in(token(roles=["reader"]))
    assert await identity.redis.keys("portico:console_session:*") == []


async def test_jwt_session_ends_with_the_token(identity: Identity) -> None:
    sessions = ConsoleSessions(identity.redis, identity.authenticator, ConsoleSettings())
    exp = int(time.time()) + 120
    session_id, session = await sessions.sign_in(token(roles=["portico:admin"], exp=exp))
    assert (session.kind, session.actor) == ("jwt", "ops")
    assert session.expires_at == exp  # not the 8 h of session_ttl_seconds
    principal = await sessions.resolve_admin(request("GET", session_id))
    assert principal.subject == "ops" and principal.key_id is None
    assert (
        0
        < await identity.redis.pttl(
            next(iter(await identity.redis.keys("portico:console_session:*")))
        )
        <= 120_000
    )
    sessions.clock = lambda: exp + 1.0  # past the token's exp: the session is over
    assert await sessions.find(session_id) is None


async def test_a_new_admin_key_ends_the_old_keys_sessions(
    identity: Identity, redis_url: str, tmp_path: Path
) -> None:
    old = ConsoleSessions(identity.redis, identity.authenticator)
    session_id, _ = await old.sign_in(ADMIN_KEY)
    redis, restarted = await open_ident(redis_url, tmp_path / "new", "adm-" + "n" * 40)
    try:
        sessions = ConsoleSessions(restarted.redis, restarted.authenticator)
        assert await sessions.find(session_id) is None
        with pytest.raises(AuthenticationError):
            await sessions.resolve_admin(request("GET", session_id))
    finally:
        await restarted.aclose()
        await redis.aclose()


@pytest.mark.parametrize(
    ("tls_in_gateway", "base_url", "secure"),
    [(True, "http://gw", True), (False, "https://gw", True), (False, "http://gw", False)],
)
async def test_cookie_is_secure_when_tls_is_on(
    identity: Identity, tls_in_gateway: bool, base_url: str, secure: bool
) -> None:
    app = FastAPI()
    install_error_handlers(app)
    sessions = ConsoleSessions(identity.redis, identity.authenticator)
    app.include_router(
        build_console_router(sessions, AuditLog(identity.redis), secure_cookies=tls_in_gateway)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
        resp = await client.post("/admin/ui/session", json={"credential": ADMIN_KEY})
    assert resp.status_code == 200, resp.text
    attributes = [p.strip().lower() for p in resp.headers["set-cookie"].split(";")]
    assert ("secure" in attributes) is secure
    assert "httponly" in attributes and "samesite=strict" in attributes
