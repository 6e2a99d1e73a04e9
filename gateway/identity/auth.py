"""The one principal resolver: an ``Authorization`` header in, a :class:`Principal` out.

Data plane (:meth:`Authenticator.resolve`): ``Bearer sk-...`` API keys and bearer JWTs that
name a tenant. Admin API (:meth:`Authenticator.resolve_admin`): the admin key, or a JWT that
carries the admin role. Credentials are never logged and never echoed in an error.

Key resolution costs one Redis round trip on a cache miss and none on a hit; the in-process
cache keeps a resolved principal at most ``key_cache_ttl_seconds`` (default 2 s), so a
revocation, an expiry or a tenant change made on any gateway replica takes effect within that
window (at once on the replica that made it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from gateway.identity.jwt_auth import JWTSettings, JWTVerifier
from gateway.identity.plans import load_plans
from gateway.identity.principal import Limits, Principal
from gateway.identity.provider_keys import ProviderKeyStore
from gateway.identity.records import Tenant
from gateway.identity.tenants import TenantStore
from gateway.store import RedisClient, StoreSettings
from portico.errors import AuthenticationError, PermissionDeniedError, ServiceUnavailableError

__all__ = [
    "ADMIN_KEY_ENV",
    "KEY_HASH_SECRET_ENV",
    "AuthSettings",
    "Authenticator",
    "Identity",
    "JWTSettings",
    "open_identity",
]

log = logging.getLogger(__name__)

ADMIN_KEY_ENV = "PORTICO_ADMIN_KEY"
KEY_HASH_SECRET_ENV = "PORTICO_KEY_HASH_SECRET"
KEY_HASH_SECRET_FILENAME = "key_hash_secret"
MIN_ADMIN_KEY_CHARS = 16
MAX_CREDENTIAL_CHARS = 8192
MAX_CACHE_ENTRIES = 100_000

_NO_CREDENTIAL = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_BAD_KEY = "Incorrect API key provided."


class AuthSettings(BaseModel):
    """Credentials configuration. Secrets come from files or the environment, never from the
    YAML itself, so a config file can be shared without leaking them."""

    model_config = ConfigDict(extra="forbid")

    admin_key_file: Path | None = None
    key_hash_secret_file: Path | None = None
    key_cache_ttl_seconds: float = Field(default=2.0, ge=0, le=30)
    # While Redis is unreachable (and admission.redis_down_policy is local or open), a key or
    # JWT tenant verified against Redis within this many seconds keeps working from a local
    # copy; 0 turns the copy off. See docs/operations.md (outages) for what it means for
    # revocation.
    outage_copy_seconds: float = Field(default=3600.0, ge=0, le=86400)
    jwt: JWTSettings | None = None


def load_admin_key(settings: AuthSettings, env: Mapping[str, str]) -> str | None:
    """The admin key from ``admin_key_file``, else ``$PORTICO_ADMIN_KEY``; None: admin key off.

    Raises ValueError when the key is shorter than 16 characters.
    """
    if settings.admin_key_file is not None:
        key = settings.admin_key_file.read_text().strip()
    else:
        key = env.get(ADMIN_KEY_ENV, "").strip()
    if not key:
        return None
    if len(key) < MIN_ADMIN_KEY_CHARS:
        raise ValueError(f"the admin key must be at least {MIN_ADMIN_KEY_CHARS} characters")
    return key


def load_key_hash_secret(settings: AuthSettings, data_dir: Path, env: Mapping[str, str]) -> bytes:
    """The HMAC secret keys are hashed with: ``key_hash_secret_file``, else
    ``$PORTICO_KEY_HASH_SECRET``, else ``data_dir/key_hash_secret`` (generated on first start,
    mode 0600). Every replica sharing a Redis must use the same secret."""
    if settings.key_hash_secret_file is not None:
        raw = settings.key_hash_secret_file.read_bytes().strip()
    elif env.get(KEY_HASH_SECRET_ENV):
        raw = env[KEY_HASH_SECRET_ENV].strip().encode()
    else:
        raw = _generated_secret(data_dir / KEY_HASH_SECRET_FILENAME)
    if len(raw) < 16:
        raise ValueError("the key hash secret must be at least 16 bytes")
    return raw


def _generated_secret(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s is readable by other users; chmod 600 it", path)
        return path.read_bytes().strip()
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    log.info("generated a new key hash secret in %s", path)
    return path.read_bytes().strip()


def _confirm(copy: dict[str, Any], name: str, value: Any) -> None:
    """Put ``name`` last in the bounded outage copy (the oldest confirmation goes first)."""
    copy.pop(name, None)
    if len(copy) >= MAX_CACHE_ENTRIES:
        del copy[next(iter(copy))]
    copy[name] = value


@dataclass
class _Cached:
    principal: Principal
    until: float  # monotonic: when this entry stops being trusted
    expires_at: float  # wall clock: the key's own expiry or scheduled revocation (inf: none)


class Authenticator:
    """Resolves credentials to principals; the only place that does.

    Raises :class:`AuthenticationError` (401) for a missing, malformed, unknown, expired or
    revoked credential and :class:`PermissionDeniedError` (403) for a valid credential that may
    not do this (disabled tenant; a data-plane key on the admin API; a JWT without the admin
    role on the admin API).
    """

    def __init__(
        self,
        store: TenantStore,
        *,
        admin_key: str | None = None,
        jwt: JWTVerifier | None = None,
        cache_ttl_seconds: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.jwt = jwt
        self.cache_ttl_seconds = cache_ttl_seconds
        self._clock = clock  # cache ages
        self._wall_clock = wall_clock  # key expiry and revocation times (unix seconds)
        # Compare digests, not the keys: equal lengths, and the admin key is not kept around.
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        self._keys: dict[str, _Cached] = {}
        self._tenants: dict[str, tuple[Tenant | None, float]] = {}
        # The outage copy: what Redis last confirmed, with when (monotonic), oldest first.
        self.outage_copy_seconds = 0.0
        self._confirmed_keys: dict[str, tuple[_Cached, float]] = {}
        self._confirmed_tenants: dict[str, tuple[Tenant, float]] = {}

    def keep_outage_copy(self, seconds: float) -> None:
        """Serve credentials Redis confirmed within ``seconds`` while Redis is unreachable
        (0: refuse with 503 instead). The gateway turns it on unless admission is ``closed``."""
        self.outage_copy_seconds = seconds
        if seconds <= 0:
            self._confirmed_keys.clear()
            self._confirmed_tenants.clear()

    @property
    def admin_key_id(self) -> str | None:
        """A stable name for the admin key (a prefix of its SHA-256), for the audit log."""
        digest = self._admin_digest
        return None if digest is None else f"admin-{digest.hex()[:12]}"

    @property
    def admin_key_enabled(self) -> bool:
        return self._admin_digest is not None

    def invalidate(self) -> None:
        """Forget every cached principal (the admin API calls this after each write)."""
        self._keys.clear()
        self._tenants.clear()
        # A write may be a revocation: nothing confirmed before it may outlive it here.
        self._confirmed_keys.clear()
        self._confirmed_tenants.clear()

    # ------------------------------------------------------------------ data plane

    async def resolve(self, authorization: str | None) -> Principal:
        """The principal of a data-plane request (API key or tenant JWT)."""
        token = _bearer(authorization)
        if token.startswith("sk-"):
            return await self._resolve_key(token)
        if self.jwt is not None and token.count(".") == 2:
            verified = await self.jwt.verify(token)
            if verified.tenant_id is None:
                raise AuthenticationError(
                    f"Invalid token: missing the '{self.jwt.settings.tenant_claim}' claim.",
                    code="invalid_token",
                )
            tenant = await self._tenant(verified.tenant_id)
            if tenant is None:
                raise AuthenticationError("Invalid token: unknown tenant.", code="invalid_token")
            _check_enabled(tenant)
            principal = self.store.principal_for(
                tenant, subject=verified.subject, scopes=verified.scopes
            )
            return principal
        raise AuthenticationError(_BAD_KEY)

    async def _resolve_key(self, secret: str) -> Principal:
        digest = self.store.digest(secret)
        now = self._clock()
        cached = self._keys.get(digest)
        if cached is not None and now < cached.until and self._wall_clock() < cached.expires_at:
            return cached.principal
        try:
            found = await self.store.lookup_digest(digest)
        except RedisError as exc:
            copy = self._confirmed_keys.get(digest)
            if (
                copy is not None
                and now - copy[1] <= self.outage_copy_seconds
                and self._wall_clock() < copy[0].expires_at
            ):
                return copy[0].principal
            raise _store_down(exc) from None
        if found is None:
            raise AuthenticationError(_BAD_KEY)
        key, tenant = found
        if not key.is_active(self._wall_clock()) or tenant is None:
            raise AuthenticationError("This API key has been revoked or has expired.")
        _check_enabled(tenant)
        principal = self.store.principal_for(tenant, key)
        ends = [t for t in (key.expires_at, key.revoked_at) if t is not None]
        entry = _Cached(
            principal, now + self.cache_ttl_seconds, min(ends) if ends else float("inf")
        )
        if self.cache_ttl_seconds > 0:
            self._remember(digest, entry)
        if self.outage_copy_seconds > 0:
            _confirm(self._confirmed_keys, digest, (entry, now))
        return principal

    async def _tenant(self, tenant_id: str) -> Tenant | None:
        now = self._clock()
        hit = self._tenants.get(tenant_id)
        if hit is not None and now < hit[1]:
            return hit[0]
        try:
            tenant = await self.store.get_tenant(tenant_id)
        except RedisError as exc:
            copy = self._confirmed_tenants.get(tenant_id)
            if copy is not None and now - copy[1] <= self.outage_copy_seconds:
                return copy[0]
            raise _store_down(exc) from None
        if tenant is not None and self.outage_copy_seconds > 0:
            _confirm(self._confirmed_tenants, tenant_id, (tenant, now))
        if self.cache_ttl_seconds > 0:
            if len(self._tenants) >= MAX_CACHE_ENTRIES:
                self._tenants.clear()
            self._tenants[tenant_id] = (tenant, now + self.cache_ttl_seconds)
        return tenant

    def _remember(self, digest: str, entry: _Cached) -> None:
        if len(self._keys) >= MAX_CACHE_ENTRIES:
            now = self._clock()
            self._keys = {d: c for d, c in self._keys.items() if c.until > now}
            if len(self._keys) >= MAX_CACHE_ENTRIES:
                self._keys.clear()
        self._keys[digest] = entry

    # ------------------------------------------------------------------ admin

    async def resolve_admin(self, authorization: str | None) -> Principal:
        """The principal of an admin API request: the admin key or an admin-role JWT."""
        token = _bearer(authorization)
        if self._admin_digest is not None and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self._admin_digest
        ):
            return Principal(
                tenant_id="*",
                plan="admin",
                limits=Limits(),
                key_id=self.admin_key_id,  # names the key in the audit log, never reveals it
                subject="admin-key",
                scopes=frozenset({"admin"}),
                is_admin=True,
            )
        if self.jwt is not None and token.count(".") == 2:
            verified = await self.jwt.verify(token)
            if not verified.is_admin:
                raise PermissionDeniedError("This token does not carry the admin role.")
            return Principal(
                tenant_id="*",
                plan="admin",
                limits=Limits(),
                subject=verified.subject,
                scopes=verified.scopes,
                is_admin=True,
            )
        if token.startswith("sk-") and await self._is_valid_key(token):
            raise PermissionDeniedError("API keys cannot access the admin API.")
        raise AuthenticationError("Incorrect admin credential provided.")

    async def _is_valid_key(self, secret: str) -> bool:
        try:
            await self._resolve_key(secret)
        except (AuthenticationError, PermissionDeniedError):
            return False
        return True

    async def aclose(self) -> None:
        if self.jwt is not None:
            await self.jwt.aclose()


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationError(_NO_CREDENTIAL, code="missing_api_key")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(_NO_CREDENTIAL, code="missing_api_key")
    # stripped, so whitespace anywhere in it splits it (str.split's is str.isspace's)
    if len(token) > MAX_CREDENTIAL_CHARS or len(token.split(maxsplit=1)) > 1:
        raise AuthenticationError(_BAD_KEY)
    return token


def _store_down(exc: RedisError) -> ServiceUnavailableError:
    """Fail closed but say why: a credential cannot be checked while Redis is unreachable."""
    log.warning("credential check failed: Redis unavailable (%s)", type(exc).__name__)
    return ServiceUnavailableError(
        "Authentication is temporarily unavailable; retry shortly.", headers={"retry-after": "1"}
    )


def _check_enabled(tenant: Tenant) -> None:
    if tenant.disabled:
        raise PermissionDeniedError("This tenant is disabled.", code="tenant_disabled")


class Identity:
    """What identity holds for the gateway's lifetime: the tenant store, the authenticator and
    the tenants' provider keys, all on the Redis client it was handed (the gateway owns and
    closes that client)."""

    def __init__(
        self,
        redis: RedisClient,
        store: TenantStore,
        authenticator: Authenticator,
        provider_keys: ProviderKeyStore | None = None,
    ) -> None:
        self.redis = redis
        self.store = store
        self.authenticator = authenticator
        self.provider_keys = provider_keys

    async def aclose(self) -> None:
        await self.authenticator.aclose()


def open_identity(
    redis: RedisClient,
    store: StoreSettings,
    auth: AuthSettings,
    env: Mapping[str, str] | None = None,
) -> Identity:
    """Load plans and secrets and build the tenant store and the authenticator on ``redis``.

    Raises ValueError for bad plans or secrets, before anything is built.
    """
    env = os.environ if env is None else env
    plans = load_plans(store.plans_file)
    admin_key = load_admin_key(auth, env)
    key_secret = load_key_hash_secret(auth, store.data_dir, env)
    verifier = JWTVerifier(auth.jwt, env) if auth.jwt is not None else None
    if admin_key is None and not (auth.jwt is not None):
        log.warning(
            "no admin key (%s) and no JWT: the admin API refuses every request", ADMIN_KEY_ENV
        )
    tenants = TenantStore(redis, key_secret, plans)
    authenticator = Authenticator(
        tenants, admin_key=admin_key, jwt=verifier, cache_ttl_seconds=auth.key_cache_ttl_seconds
    )
    provider_keys = ProviderKeyStore(
        redis, key_secret, cache_ttl_s=auth.key_cache_ttl_seconds
    )  # sealed under a key derived from the same secret (provider_keys.py)
    return Identity(redis, tenants, authenticator, provider_keys)
