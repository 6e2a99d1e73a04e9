"""Console sessions: a signed-in admin's browser session, kept in Redis, with a CSRF token.

Signing in checks the admin credential once (``Authenticator.resolve_admin``) and stores a
session under the SHA-256 of a random id; the browser holds the id only in an HttpOnly,
SameSite=Strict cookie (Secure when the gateway serves TLS), so page scripts never see the
credential or the session id. The session keeps who signed in (the admin key's id or the JWT's
subject), a CSRF token and an expiry (``console.session_ttl_seconds``, and never past an admin
JWT's own ``exp``). Sessions live in Redis so every gateway replica honours them, and expire
there by TTL.

:meth:`ConsoleSessions.resolve_admin` is the admin API's credential check with sessions added:
an ``Authorization`` header is checked as before; without one, a session cookie is accepted,
and for every method that changes something the ``X-CSRF-Token`` header must equal the
session's token (compared in constant time). A session of an admin key that is no longer the
configured one is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from gateway.identity.auth import Authenticator
from gateway.identity.principal import Limits, Principal
from portico.errors import AuthenticationError, PermissionDeniedError

COOKIE_NAME = "portico_console"
CSRF_HEADER = "x-csrf-token"
COOKIE_PATH = "/admin"
SESSION_PREFIX = "portico:console_session:"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_COOKIE_CHARS = 128


class ConsoleSettings(BaseModel):
    """The admin console under ``/admin/ui``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    session_ttl_seconds: int = Field(default=8 * 3600, ge=60, le=7 * 86400)


@dataclass(frozen=True)
class Session:
    """A signed-in console session (what Redis holds, by the hash of its id)."""

    actor: str  # the admin key's id, or the JWT's subject
    kind: str  # "admin_key" | "jwt"
    csrf_token: str
    expires_at: float  # unix seconds

    def principal(self) -> Principal:
        return Principal(
            tenant_id="*",
            plan="admin",
            limits=Limits(),
            key_id=self.actor if self.kind == "admin_key" else None,
            subject="admin-key" if self.kind == "admin_key" else self.actor,
            scopes=frozenset({"admin"}),
            is_admin=True,
        )


def _storage_key(session_id: str) -> str:
    return SESSION_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()


class ConsoleSessions:
    """Creates, finds and ends console sessions on the gateway's Redis."""

    def __init__(
        self,
        redis: Any,
        authenticator: Authenticator,
        settings: ConsoleSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.authenticator = authenticator
        self.settings = settings or ConsoleSettings()
        self.clock = clock  # unix seconds

    async def sign_in(self, credential: str) -> tuple[str, Session]:
        """A new session for an admin credential; 401/403 as the admin API would answer."""
        authorization = f"Bearer {credential}"
        principal = await self.authenticator.resolve_admin(authorization)
        now = self.clock()
        expires = now + self.settings.session_ttl_seconds
        if principal.key_id is not None:
            actor, kind = principal.key_id, "admin_key"
        else:
            actor, kind = principal.subject or "unknown", "jwt"
            verifier = self.authenticator.jwt
            if verifier is not None:  # never outlive the token that opened the session
                exp = (await verifier.verify(credential)).claims.get("exp")
                if isinstance(exp, int | float):
                    expires = min(expires, float(exp))
        session = Session(actor, kind, secrets.token_urlsafe(32), expires)
        session_id = secrets.token_urlsafe(32)
        ttl_ms = max(1, int((expires - now) * 1000))
        body = json.dumps(
            {"actor": actor, "kind": kind, "csrf": session.csrf_token, "expires": expires}
        )
        await self.redis.set(_storage_key(session_id), body, px=ttl_ms)
        return session_id, session

    async def find(self, session_id: str | None) -> Session | None:
        """The live session of this id, or None (unknown, expired, or of a replaced key)."""
        if not session_id or len(session_id) > MAX_COOKIE_CHARS:
            return None
        raw = await self.redis.get(_storage_key(session_id))
        if raw is None:
            return None
        data = json.loads(raw)
        session = Session(data["actor"], data["kind"], data["csrf"], float(data["expires"]))
        if session.expires_at <= self.clock():
            return None
        if session.kind == "admin_key" and session.actor != self.authenticator.admin_key_id:
            return None  # the admin key was changed since: its sessions end with it
        return session

    async def sign_out(self, session_id: str | None) -> None:
        if session_id and len(session_id) <= MAX_COOKIE_CHARS:
            await self.redis.delete(_storage_key(session_id))

    async def resolve_admin(self, request: Request) -> Principal:
        """The admin principal of an admin API request: its bearer credential, else its
        console session (with the CSRF token on every change)."""
        authorization = request.headers.get("authorization")
        session_id = request.cookies.get(COOKIE_NAME)
        if authorization or not session_id:
            return await self.authenticator.resolve_admin(authorization)
        session = await self.find(session_id)
        if session is None:
            raise AuthenticationError(
                "Your console session has expired; sign in again.", code="session_expired"
            )
        if request.method not in SAFE_METHODS:
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), session.csrf_token.encode()):
                raise PermissionDeniedError(
                    "Missing or wrong CSRF token.", code="csrf_token_invalid"
                )
        return session.principal()
