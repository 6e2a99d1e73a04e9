"""Tenants' own provider keys for remote upstreams (``remotes[].tenant_keys``).

A Portico key is stored as a hash because the gateway only ever compares it. A provider key
must be *sent* onward, so a hash will not do: it is stored encrypted, AES-256-GCM under a key
derived (HKDF-SHA-256) from the gateway's key-hash secret, with the tenant id and the remote
name as associated data, so a ciphertext copied to another tenant's or remote's slot does not
decrypt. The admin API sets, lists and deletes keys but never returns one (the listing shows
only which remotes have a key and when it was set); the plaintext lives only in this process's
memory for ``cache_ttl_s`` and in the request it authorises. Rotating the key-hash secret makes
the stored keys unreadable (as it invalidates every Portico key): set them again.

Redis layout: ``portico:provider_keys:{<tenant_id>}`` (hash-tagged by tenant) is a hash, remote
name -> JSON
``{"sealed": base64(nonce + ciphertext), "set_at": unix seconds}``.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from gateway.identity.audit import Actor, AuditLog
from gateway.identity.principal import Principal
from gateway.store import RedisClient
from portico.errors import InvalidRequestError, NotFoundError

if TYPE_CHECKING:  # auth builds the store: no import at run time
    from gateway.identity.auth import Authenticator
    from gateway.identity.tenants import TenantStore

PREFIX = "portico:provider_keys:"


def tenant_key(tenant_id: str) -> str:
    """The tenant's hash, hash-tagged by tenant like its other keys (Redis Cluster)."""
    return f"{PREFIX}{{{tenant_id}}}"


HKDF_INFO = b"portico provider keys v1"
MAX_CACHE_ENTRIES = 100_000


def _aad(tenant_id: str, remote: str) -> bytes:
    return tenant_id.encode() + b"\x00" + remote.encode()


class ProviderKeyStore:
    """Sealed provider keys per (tenant, remote), with a short in-process cache for the hot path.

    ``get`` costs one Redis round trip on a miss (absent keys are cached too) and none on a hit;
    a key set or deleted on another replica takes effect within ``cache_ttl_s``.
    """

    def __init__(self, redis: RedisClient, secret: bytes, *, cache_ttl_s: float = 2.0) -> None:
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=HKDF_INFO).derive(
            secret
        )
        self._aead = AESGCM(derived)
        self.redis = redis
        self.cache_ttl_s = cache_ttl_s
        self._cache: dict[tuple[str, str], tuple[float, str | None]] = {}

    def seal(self, tenant_id: str, remote: str, key: str) -> str:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, key.encode(), _aad(tenant_id, remote))
        return base64.b64encode(nonce + sealed).decode()

    def open(self, tenant_id: str, remote: str, sealed: str) -> str | None:
        raw = base64.b64decode(sealed)
        try:
            return self._aead.decrypt(raw[:12], raw[12:], _aad(tenant_id, remote)).decode()
        except InvalidTag:  # another secret, or moved from another slot
            return None

    async def set(self, tenant_id: str, remote: str, key: str) -> float:
        set_at = time.time()
        record = {"sealed": self.seal(tenant_id, remote, key), "set_at": set_at}
        await self.redis.hset(tenant_key(tenant_id), remote, json.dumps(record))
        self._cache.pop((tenant_id, remote), None)
        return set_at

    async def delete(self, tenant_id: str, remote: str) -> bool:
        self._cache.pop((tenant_id, remote), None)
        return bool(await self.redis.hdel(tenant_key(tenant_id), remote))

    async def delete_tenant(self, tenant_id: str) -> None:
        await self.redis.delete(tenant_key(tenant_id))
        for slot in [s for s in self._cache if s[0] == tenant_id]:
            del self._cache[slot]

    async def listing(self, tenant_id: str) -> list[dict[str, Any]]:
        """Which remotes have a key, and since when; never the key."""
        rows = await self.redis.hgetall(tenant_key(tenant_id))
        out = []
        for remote, value in sorted(rows.items()):
            record = json.loads(value)
            name = remote.decode() if isinstance(remote, bytes) else remote
            out.append({"remote": name, "set_at": int(record["set_at"])})
        return out

    async def get(self, tenant_id: str, remote: str) -> str | None:
        slot = (tenant_id, remote)
        now = time.monotonic()
        hit = self._cache.get(slot)
        if hit is not None and hit[0] > now:
            return hit[1]
        value = await self.redis.hget(tenant_key(tenant_id), remote)
        key = self.open(tenant_id, remote, json.loads(value)["sealed"]) if value else None
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.clear()
        self._cache[slot] = (now + self.cache_ttl_s, key)
        return key


class ProviderKeySet(BaseModel):
    """The body of ``PUT /admin/v1/tenants/{id}/provider_keys/{remote}``."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=8, max_length=4096)


def build_provider_key_router(
    keys: ProviderKeyStore,
    store: TenantStore,
    authenticator: Authenticator,
    remotes: set[str],
    *,
    before_auth: Callable[[Request], Awaitable[None]] | None = None,
    audit: AuditLog | None = None,
    resolve: Callable[[Request], Awaitable[Principal]] | None = None,
) -> APIRouter:
    """Admin routes for tenants' provider keys; ``remotes`` are the remotes that take them.
    Every change goes to the audit log with when the key was set, never the key."""
    router = APIRouter(prefix="/admin/v1", tags=["admin"])
    audit_log = audit if audit is not None else AuditLog(store.redis)

    async def admin(request: Request, tenant_id: str, remote: str | None = None) -> Actor:
        if before_auth is not None:
            await before_auth(request)
        if resolve is not None:  # the console's session check (gateway/console/sessions.py)
            principal = await resolve(request)
        else:
            principal = await authenticator.resolve_admin(request.headers.get("authorization"))
        await store.require_tenant(tenant_id)
        if remote is not None and remote not in remotes:
            raise NotFoundError(
                f"No remote '{remote}' takes tenant keys (remotes[].tenant_keys).",
                param="remote",
            )
        return Actor.of_request(request, principal)

    @router.put("/tenants/{tenant_id}/provider_keys/{remote}")
    async def set_key(tenant_id: str, remote: str, request: Request) -> dict[str, Any]:
        actor = await admin(request, tenant_id, remote)
        try:
            body = ProviderKeySet.model_validate_json(await request.body())
        except ValueError:  # the message would quote the key: say only what is wrong
            raise InvalidRequestError(
                'The body must be {"key": "<provider key>"} (8-4096 characters).',
                param="key",
            ) from None
        set_at = await keys.set(tenant_id, remote, body.key.strip())
        await audit_log.record(
            actor, "provider_key.set", f"provider_key:{tenant_id}:{remote}", tenant_id=tenant_id,
            after={"remote": remote, "set_at": int(set_at)},
        )  # fmt: skip
        return {"object": "provider_key", "remote": remote, "set_at": int(set_at)}

    @router.get("/tenants/{tenant_id}/provider_keys")
    async def list_keys(tenant_id: str, request: Request) -> dict[str, Any]:
        await admin(request, tenant_id)
        data = [{"object": "provider_key", **row} for row in await keys.listing(tenant_id)]
        return {"object": "list", "data": data}

    @router.delete("/tenants/{tenant_id}/provider_keys/{remote}")
    async def delete_key(tenant_id: str, remote: str, request: Request) -> dict[str, Any]:
        actor = await admin(request, tenant_id, remote)
        if not await keys.delete(tenant_id, remote):
            raise NotFoundError(f"Tenant '{tenant_id}' has no key for '{remote}'.", param="remote")
        await audit_log.record(
            actor, "provider_key.delete", f"provider_key:{tenant_id}:{remote}",
            tenant_id=tenant_id, before={"remote": remote},
        )  # fmt: skip
        return {"object": "provider_key", "remote": remote, "deleted": True}

    return router
