"""The tenant store: tenants and API keys in Redis, and the Principal they add up to.

The Redis key names are :mod:`gateway.identity.layout`'s: every key of one tenant (its record,
its key set, its key records, its usage) shares the tenant's hash tag, so the writes that must
go together run as one MULTI in one slot, on one server or on a Redis Cluster. Usage lives in
:mod:`gateway.identity.usage` (the store's :attr:`TenantStore.ledger`).

A key secret is ``sk-`` + 32 random bytes (url-safe base64), shown once at creation. Only its
HMAC-SHA-256 under the server's key-hash secret is stored; authentication looks the digest
up in the ``keyhash`` index, then compares it with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import BaseModel
from redis.asyncio import RedisCluster
from redis.exceptions import WatchError

from gateway.identity.layout import (
    PREFIX,
    TENANTS,
    api_key_key,
    keyhash_key,
    tenant_key,
    tenant_keys_key,
)
from gateway.identity.plans import LimitsSpec, Plan
from gateway.identity.principal import Limits, Principal
from gateway.identity.records import (
    ApiKey,
    ConflictError,
    KeyCreate,
    Tenant,
    TenantCreate,
    TenantPatch,
    display_form,
    new_key_secret,
)
from gateway.identity.usage import UsageLedger
from gateway.store import RedisClient
from portico.errors import APIError, InvalidRequestError, NotFoundError, PermissionDeniedError

Record = TypeVar("Record", bound=BaseModel)


# One round trip per authentication on one server: the digest index, then the key and tenant
# records (names as gateway/identity/layout.py builds them). A cluster cannot run it: the index
# and the records are in different slots.
_LOOKUP_LUA = """
local ids = redis.call('HMGET', KEYS[1], 'key_id', 'tenant_id')
if not ids[1] then return false end
local tag = '{' .. ids[2] .. '}'
return {redis.call('GET', ARGV[1] .. 'key:' .. tag .. ':' .. ids[1]),
        redis.call('GET', ARGV[1] .. 'tenant:' .. tag)}
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TenantStore:
    """Tenants and keys over one Redis client, a single server's or a cluster's (their usage:
    :attr:`ledger`).

    Safe for concurrent use from one event loop; read-modify-write updates use WATCH/MULTI so
    concurrent admin writes never lose an update. Writes that span the tenant's slot and a
    global key (the tenant list, the digest index) are ordered so that a failure half way
    leaves nothing that authenticates: the digest index is written last and deleted first.
    Never sees or stores a key secret except while hashing it.
    """

    def __init__(
        self, redis: RedisClient, key_hash_secret: bytes, plans: Mapping[str, Plan]
    ) -> None:
        if not plans:
            raise ValueError("plans must not be empty")
        if len(key_hash_secret) < 16:
            raise ValueError("key_hash_secret must be at least 16 bytes")
        self.redis = redis
        self.plans: Mapping[str, Plan] = MappingProxyType(dict(plans))
        self.default_plan = next(iter(plans))  # load_plans puts the default first
        self._secret = key_hash_secret
        self.ledger = UsageLedger(redis)  # usage counters, same Redis
        self._lookup = (
            None if isinstance(redis, RedisCluster) else redis.register_script(_LOOKUP_LUA)
        )

    # ------------------------------------------------------------------ hashing

    def digest(self, secret: str) -> str:
        return hmac.new(self._secret, secret.encode(), hashlib.sha256).hexdigest()

    def tenant_salt(self, tenant_id: str) -> str:
        msg = b"cache-salt:" + tenant_id.encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]

    # ------------------------------------------------------------------ tenants

    def _plan(self, name: str | None, param: str = "plan") -> str:
        name = name or self.default_plan
        if name not in self.plans:
            raise InvalidRequestError(
                f"Unknown plan {name!r}; known plans: {', '.join(sorted(self.plans))}.",
                param=param,
                code="unknown_plan",
            )
        return name

    async def create_tenant(self, spec: TenantCreate) -> Tenant:
        tenant = Tenant(
            id=spec.id or "t-" + secrets.token_hex(6),
            created=int(time.time()),
            uid=secrets.token_hex(8),
            **spec.model_dump(exclude={"id", "plan"}),
            plan=self._plan(spec.plan),
        )
        created = await self.redis.set(tenant_key(tenant.id), tenant.model_dump_json(), nx=True)
        if not created:
            raise ConflictError(f"Tenant {tenant.id!r} already exists.", param="id")
        await self.redis.sadd(TENANTS, tenant.id)
        return tenant

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        raw = await self.redis.get(tenant_key(tenant_id))
        return Tenant.model_validate_json(raw) if raw else None

    async def require_tenant(self, tenant_id: str) -> Tenant:
        tenant = await self.get_tenant(tenant_id)
        if tenant is None:
            raise NotFoundError(f"No tenant {tenant_id!r}.", code="tenant_not_found")
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        ids = sorted(_text(m) for m in await self.redis.smembers(TENANTS))
        if not ids:
            return []
        # One GET per tenant in one pipeline: each record is in its tenant's slot (a cluster
        # pipeline sends each node its share at once), where MGET needs one slot.
        pipe = self.redis.pipeline(transaction=False)
        for tenant_id in ids:
            pipe.get(tenant_key(tenant_id))
        raws = await pipe.execute()
        return [Tenant.model_validate_json(r) for r in raws if r]

    async def update_tenant(self, tenant_id: str, patch: TenantPatch) -> Tenant:
        fields = patch.model_fields_set
        if "plan" in fields:
            self._plan(patch.plan)

        def apply(tenant: Tenant) -> Tenant:
            update: dict[str, Any] = {}
            for name in ("name", "plan", "disabled", "allowed_models", "share_prefix_cache"):
                if name in fields:
                    update[name] = getattr(patch, name)
            if "plan" in fields:
                update["plan"] = self._plan(patch.plan)
            if "disabled" in fields and patch.disabled is None:
                update["disabled"] = False
            if "name" in fields and patch.name is None:
                raise InvalidRequestError("'name' cannot be null.", param="name")
            if patch.overrides is not None:
                changed = {k: getattr(patch.overrides, k) for k in patch.overrides.model_fields_set}
                update["overrides"] = tenant.overrides.model_copy(update=changed)
            elif "overrides" in fields:
                update["overrides"] = LimitsSpec()
            if patch.model_limits is not None:
                merged = dict(tenant.model_limits)
                for model, spec in patch.model_limits.items():
                    if spec is None:
                        merged.pop(model, None)
                    else:
                        merged[model] = spec
                update["model_limits"] = merged
            elif "model_limits" in fields:
                update["model_limits"] = {}
            return tenant.model_copy(update=update)

        return await self._update(
            tenant_key(tenant_id),
            Tenant,
            apply,
            NotFoundError(f"No tenant {tenant_id!r}.", code="tenant_not_found"),
        )

    async def delete_tenant(self, tenant_id: str) -> None:
        """Delete the tenant and every key of it (they stop working at once). Usage history
        stays until it expires."""
        await self.require_tenant(tenant_id)
        members = await self.redis.smembers(tenant_keys_key(tenant_id))
        keys = await self._get_keys(tenant_id, [_text(m) for m in members])
        if keys:  # the digest index first: no key authenticates from here on
            await self.redis.delete(*(keyhash_key(key.digest) for key in keys))
        pipe = self.redis.pipeline(transaction=True)  # all in the tenant's slot
        pipe.delete(tenant_key(tenant_id), tenant_keys_key(tenant_id))
        for key in keys:
            pipe.delete(api_key_key(tenant_id, key.id))
        await pipe.execute()
        await self.redis.srem(TENANTS, tenant_id)

    # ------------------------------------------------------------------ keys

    async def create_key(self, tenant_id: str, spec: KeyCreate) -> tuple[ApiKey, str]:
        """Create a key for the tenant; returns the record and the secret (shown once)."""
        tenant = await self.require_tenant(tenant_id)
        secret = new_key_secret()
        now = int(time.time())
        key = ApiKey(
            id="key-" + secrets.token_hex(8),
            tenant_id=tenant_id,
            name=spec.name,
            display=display_form(secret),
            digest=self.digest(secret),
            created=now,
            expires_at=now + spec.expires_in_seconds if spec.expires_in_seconds else None,
            scopes=list(dict.fromkeys(spec.scopes)),
            limits=spec.limits,
            tenant_uid=tenant.uid,
        )
        pipe = self.redis.pipeline(transaction=True)  # all in the tenant's slot
        pipe.set(api_key_key(tenant_id, key.id), key.model_dump_json())
        pipe.sadd(tenant_keys_key(tenant_id), key.id)
        await pipe.execute()
        # The digest index last: the key authenticates only once its record exists.
        await self.redis.hset(
            keyhash_key(key.digest), mapping={"key_id": key.id, "tenant_id": tenant_id}
        )
        return key, secret

    async def _get_keys(self, tenant_id: str, key_ids: list[str]) -> list[ApiKey]:
        if not key_ids:
            return []
        raws = await self.redis.mget([api_key_key(tenant_id, k) for k in key_ids])
        return [ApiKey.model_validate_json(r) for r in raws if r]

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        await self.require_tenant(tenant_id)
        members = await self.redis.smembers(tenant_keys_key(tenant_id))
        ids = [_text(m) for m in members]
        return sorted(await self._get_keys(tenant_id, ids), key=lambda k: (k.created, k.id))

    async def get_key(self, tenant_id: str, key_id: str) -> ApiKey:
        """The tenant's key ``key_id``; 404 when it does not exist *or belongs to another
        tenant* (the two are indistinguishable on purpose)."""
        raw = await self.redis.get(api_key_key(tenant_id, key_id))
        key = ApiKey.model_validate_json(raw) if raw else None
        if key is None or not hmac.compare_digest(key.tenant_id, tenant_id):
            raise NotFoundError(
                f"No key {key_id!r} for tenant {tenant_id!r}.", code="key_not_found"
            )
        return key

    async def revoke_key(self, tenant_id: str, key_id: str, at: int | None = None) -> ApiKey:
        """Revoke now (or at unix time ``at``); an earlier revocation is kept."""
        await self.get_key(tenant_id, key_id)
        when = int(time.time()) if at is None else at

        def apply(key: ApiKey) -> ApiKey:
            if key.revoked_at is not None and key.revoked_at <= when:
                return key
            return key.model_copy(update={"revoked_at": when})

        return await self._update(
            api_key_key(tenant_id, key_id),
            ApiKey,
            apply,
            NotFoundError(f"No key {key_id!r}.", code="key_not_found"),
        )

    async def rotate_key(
        self, tenant_id: str, key_id: str, grace_seconds: int = 0
    ) -> tuple[ApiKey, str]:
        """A new secret with the old key's name, scopes, limits and expiry; the old key is
        revoked now, or after ``grace_seconds``."""
        old = await self.get_key(tenant_id, key_id)
        if not old.is_active(time.time()):
            raise InvalidRequestError(
                f"Key {key_id!r} is revoked or expired; create a new one.",
                param="key_id",
                code="key_inactive",
            )
        remaining = None
        if old.expires_at is not None:
            remaining = max(1, old.expires_at - int(time.time()))
        new, secret = await self.create_key(
            tenant_id,
            KeyCreate(
                name=old.name, scopes=old.scopes, limits=old.limits, expires_in_seconds=remaining
            ),
        )

        def link(key: ApiKey) -> ApiKey:
            revoked = int(time.time()) + grace_seconds
            if key.revoked_at is not None:
                revoked = min(revoked, key.revoked_at)
            return key.model_copy(update={"revoked_at": revoked, "replaced_by": new.id})

        await self._update(
            api_key_key(tenant_id, key_id),
            ApiKey,
            link,
            NotFoundError(f"No key {key_id!r}.", code="key_not_found"),
        )
        return new, secret

    async def lookup_key(self, secret: str) -> tuple[ApiKey, Tenant | None] | None:
        """The key record for ``secret`` and its tenant (None if the tenant is gone, or was
        re-created under the same id since). None when no key has this secret."""
        return await self.lookup_digest(self.digest(secret))

    async def lookup_digest(self, digest: str) -> tuple[ApiKey, Tenant | None] | None:
        """:meth:`lookup_key` for a digest already computed with :meth:`digest`.

        One round trip on one server (a script); two on a cluster, where the digest index (a
        global key) and the tenant's records live in different slots: the index, then the key
        and tenant records in one MGET (they share the tenant's slot). The authenticator
        caches the answer either way."""
        found = await self._fetch_key_and_tenant(digest)
        if found is None:
            return None
        raw_key, raw_tenant = found
        if not raw_key:
            return None
        key = ApiKey.model_validate_json(raw_key)
        if not hmac.compare_digest(key.digest, digest):
            return None
        tenant = Tenant.model_validate_json(raw_tenant) if raw_tenant else None
        if tenant is not None and not hmac.compare_digest(tenant.uid, key.tenant_uid):
            tenant = None  # the key outlived its tenant (deleted, id reused): an orphan
        return key, tenant

    async def _fetch_key_and_tenant(self, digest: str) -> list[Any] | None:
        if self._lookup is not None:
            found = await self._lookup(keys=[keyhash_key(digest)], args=[PREFIX])
            return list(found) if found else None
        key_id, tenant_id = await self.redis.hmget(keyhash_key(digest), ["key_id", "tenant_id"])
        if key_id is None or tenant_id is None:
            return None
        tenant = _text(tenant_id)
        return list(await self.redis.mget([api_key_key(tenant, _text(key_id)), tenant_key(tenant)]))

    # ------------------------------------------------------------------ principals

    def principal_for(
        self,
        tenant: Tenant,
        key: ApiKey | None = None,
        *,
        subject: str | None = None,
        scopes: frozenset[str] | None = None,
    ) -> Principal:
        """The Principal of a caller of ``tenant`` (through ``key``, or a JWT ``subject``).

        Raises PermissionDeniedError when the tenant's plan is no longer configured.
        """
        plan = self.plans.get(tenant.plan)
        if plan is None:
            raise PermissionDeniedError(
                "This tenant's plan is not configured on the gateway.", code="plan_unavailable"
            )
        allowed = (
            tenant.allowed_models if tenant.allowed_models is not None else plan.allowed_models
        )
        model_limits = {m: s.to_limits() for m, s in plan.model_limits.items()}
        for model, spec in tenant.model_limits.items():
            model_limits[model] = spec.over(model_limits.get(model, Limits()))
        shared = (
            tenant.share_prefix_cache
            if tenant.share_prefix_cache is not None
            else plan.share_prefix_cache
        )
        if scopes is None:
            scopes = frozenset(key.scopes) if key is not None else frozenset()
        return Principal(
            tenant_id=tenant.id,
            plan=plan.name,
            limits=tenant.overrides.over(plan.to_limits()),
            key_id=key.id if key is not None else None,
            subject=subject,
            allowed_models=frozenset(allowed) if allowed is not None else None,
            scopes=scopes,
            key_limits=key.limits.to_limits() if key is not None and key.limits else None,
            model_limits=MappingProxyType(model_limits),
            cache_salt=f"shared:{plan.name}" if shared else self.tenant_salt(tenant.id),
            shared_prefixes=tuple(plan.shared_prefixes),
            share=plan.engine_share(),
            image_models=frozenset(plan.image_models) if plan.image_models is not None else None,
        )

    # ------------------------------------------------------------------ internals

    async def _update(
        self, key: str, model: type[Record], apply: Callable[[Record], Record], missing: APIError
    ) -> Record:
        """Read-modify-write one JSON record under WATCH; retried on a concurrent write."""
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise missing
                    updated = apply(model.model_validate_json(raw))
                    pipe.multi()
                    pipe.set(key, updated.model_dump_json())
                    await pipe.execute()
                    return updated
                except WatchError:
                    continue
