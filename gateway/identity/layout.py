"""Where identity's records live in Redis: the key names, and the move from the old names.

Every key that belongs to one tenant carries the tenant id as its hash tag (``{acme}``), so the
tenant's record, its key set, its API key records and its usage land in one Redis Cluster slot
with the admission buckets (``portico:rl:{acme}:...``, gateway/admission/admission.py). That is
what lets a transaction or a script touch several of them on a cluster. Two keys are global:
``portico:tenants`` (the set of tenant ids, for listing) and ``portico:keyhash:<digest>`` (the
authentication index: a digest does not know its tenant).

Layout 2 (this one)::

    portico:tenants                        SET   tenant ids
    portico:tenant:{<tenant>}              JSON  tenant record
    portico:tenant_keys:{<tenant>}         SET   the tenant's key ids
    portico:key:{<tenant>}:<key_id>        JSON  key record (HMAC digest, never the secret)
    portico:keyhash:<digest>               HASH  key_id, tenant_id
    portico:usage:{<tenant>}:<YYYY-MM-DD>  HASH  usage counters
    portico:layout                         "2"

Layout 1 (before Redis Cluster support) had the same keys without braces and key records as
``portico:key:<key_id>``. :func:`migrate_layout` moves a layout-1 store to layout 2 once, at
the gateway's start; it is idempotent and safe to run from several replicas at once.
"""

from __future__ import annotations

import json
import logging

from redis.exceptions import ResponseError

from gateway.store import RedisClient

log = logging.getLogger(__name__)

PREFIX = "portico:"
LAYOUT_KEY = f"{PREFIX}layout"
LAYOUT_VERSION = b"2"
TENANTS = f"{PREFIX}tenants"


def tenant_key(tenant_id: str) -> str:
    return f"{PREFIX}tenant:{{{tenant_id}}}"


def tenant_keys_key(tenant_id: str) -> str:
    return f"{PREFIX}tenant_keys:{{{tenant_id}}}"


def api_key_key(tenant_id: str, key_id: str) -> str:
    return f"{PREFIX}key:{{{tenant_id}}}:{key_id}"


def keyhash_key(digest: str) -> str:
    return f"{PREFIX}keyhash:{digest}"


def usage_key(tenant_id: str, day: str) -> str:
    return f"{PREFIX}usage:{{{tenant_id}}}:{day}"


def _new_name(old: str, value: bytes | str | None) -> str | None:
    """The layout-2 name of layout-1 key ``old`` (None: not an identity key of layout 1).
    ``value`` is the key's content, needed for key records (their name gains the tenant)."""
    if "{" in old or not old.startswith(PREFIX):
        return None
    kind, _, rest = old[len(PREFIX) :].partition(":")
    if not rest:
        return None
    if kind == "tenant":
        return tenant_key(rest)
    if kind == "tenant_keys":
        return tenant_keys_key(rest)
    if kind == "usage":
        tenant_id, sep, day = rest.rpartition(":")
        return usage_key(tenant_id, day) if sep and tenant_id else None
    if kind == "key" and value is not None:
        try:
            tenant_id = json.loads(value)["tenant_id"]
        except (ValueError, KeyError, TypeError):
            return None
        return api_key_key(str(tenant_id), rest)
    return None


async def migrate_layout(redis: RedisClient) -> int:
    """Move a layout-1 store to layout 2; the number of keys moved (0 once done).

    ``redis`` is the gateway's client (one server or a cluster: SCAN visits every master).
    Each key is copied with DUMP/RESTORE (its TTL kept), then the old name deleted, which
    works across cluster slots where RENAME does not. A key already present under its new
    name is never overwritten (another replica moved it first, and may have updated it since).
    Run it with no gateway of an older version writing to the same Redis.
    """
    if await redis.get(LAYOUT_KEY) == LAYOUT_VERSION:
        return 0
    moved = 0
    for pattern in ("tenant:*", "tenant_keys:*", "key:*", "usage:*"):
        async for raw_name in redis.scan_iter(match=PREFIX + pattern, count=1000):
            old = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            if "{" in old:
                continue
            value = await redis.get(old) if pattern == "key:*" else None
            new = _new_name(old, value)
            if new is None:
                continue
            moved += await _move(redis, old, new)
    await redis.set(LAYOUT_KEY, LAYOUT_VERSION)
    if moved:
        log.warning(
            "moved %d Redis keys to the hash-tagged layout %s", moved, LAYOUT_VERSION.decode()
        )
    return moved


async def _move(redis: RedisClient, old: str, new: str) -> int:
    dump = await redis.dump(old)
    if dump is None:  # moved by another replica meanwhile
        return 0
    ttl_ms = await redis.pttl(old)
    try:
        await redis.restore(new, max(0, ttl_ms), dump)
    except ResponseError as exc:
        if "BUSYKEY" not in str(exc):
            raise
    await redis.delete(old)
    return 1
