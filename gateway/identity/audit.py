"""The audit log: every admin change, who made it, what it was before and after.

One entry per successful change made through the admin API (tenants, keys, adapters): who
(``actor``: ``admin-key`` or the admin JWT's subject, and ``actor_kind``), what (``action``
such as ``tenant.update``, ``target``, ``tenant_id``), ``before`` and ``after`` (the records as
the admin API shows them, with every secret removed), when (``time``, unix seconds) and from
where (``address``, the client address the gateway saw, and ``request_id``).

Entries are appended to one Redis Stream (``XADD``), so every gateway replica writes to the
same log, in order, and nothing in Portico edits or deletes an entry; the only removal is
retention, applied by the append itself (one Lua script, Redis's clock): entries older than
``retention_days`` (``MINID``) and beyond the newest ``max_entries`` (``MAXLEN``) go. Trimming
is exact: admin changes are rare, so ``~``'s saving is not needed. Each entry is also written
as one JSON log line on the ``portico.audit`` logger, before the Redis write, so a log shipper
keeps a copy even while Redis is down.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.requests import Request

from gateway.identity.principal import Principal

log = logging.getLogger("portico.audit")

STREAM_KEY = "portico:audit"
REQUEST_CONTEXT_KEY = "portico.ctx"  # gateway/relay/request_context.py's CTX_KEY
# Fields that hold a secret, something derived from one, or an internal nonce (a tenant's
# uid); dropped at any depth.
SECRET_FIELDS = frozenset({"key", "secret", "digest", "uid", "tenant_uid", "password", "token"})
MAX_PAGE = 500
# Append and trim in one step, with Redis's clock deciding age (the stream ids are Redis's
# milliseconds too, so every replica agrees on what "older than retention_days" means).
# ARGV: retention in ms (0: none), max entries (0: none), then field, value, ...
_APPEND = """
local retention_ms, max_entries = tonumber(ARGV[1]), tonumber(ARGV[2])
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
if retention_ms > 0 then
  local now = redis.call('TIME')
  local oldest = math.max(0, tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
                              - retention_ms)
  redis.call('XADD', KEYS[1], 'MINID', tostring(oldest), '*', unpack(fields))
else
  redis.call('XADD', KEYS[1], '*', unpack(fields))
end
if max_entries > 0 then redis.call('XTRIM', KEYS[1], 'MAXLEN', max_entries) end
return 1
"""
SCAN_BATCH = 200
MAX_SCAN = 10_000  # entries one read looks at; a sparse filter pages on with the cursor


class AuditSettings(BaseModel):
    """Retention of the audit stream: entries older than ``retention_days`` and beyond the
    newest ``max_entries`` are trimmed on each append (0 turns that bound off)."""

    model_config = ConfigDict(extra="forbid")

    retention_days: float = Field(default=365.0, ge=0, le=36500)
    max_entries: int = Field(default=1_000_000, ge=0)


def scrub(value: Any) -> Any:
    """``value`` with every secret field removed, at any depth (dicts and lists)."""
    if isinstance(value, Mapping):
        return {k: scrub(v) for k, v in value.items() if k not in SECRET_FIELDS}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


@dataclass(frozen=True)
class Actor:
    """Who made a change and from where."""

    name: str  # the admin key's id ("admin-<sha256 prefix>"), or the admin JWT's subject
    kind: str  # "admin_key" | "jwt"
    address: str
    request_id: str | None = None

    @classmethod
    def of(cls, principal: Principal, address: str, request_id: str | None = None) -> Actor:
        """The actor of an admin principal (``Authenticator.resolve_admin``): only the admin
        key's principal carries a ``key_id``; a JWT's carries its subject."""
        if principal.key_id is not None:
            return cls(principal.key_id, "admin_key", address, request_id)
        return cls(principal.subject or "unknown", "jwt", address, request_id)

    @classmethod
    def of_request(cls, request: Request, principal: Principal) -> Actor:
        """The actor of an admin request: its principal, the client address, and the request
        id the edge gave it (``RequestContextMiddleware`` keeps it in the scope)."""
        address = request.client.host if request.client else "unknown"
        request_id = getattr(request.scope.get(REQUEST_CONTEXT_KEY), "request_id", None)
        return cls.of(principal, address, request_id)


@dataclass(frozen=True)
class AuditEntry:
    """One audit entry as the admin API returns it."""

    id: str  # the stream id, "<ms>-<seq>": ordered, unique
    time: float
    actor: str
    actor_kind: str
    address: str
    request_id: str | None
    action: str
    target: str
    tenant_id: str | None
    before: Any
    after: Any


class AuditLog:
    """Appends to and reads the audit stream. Safe to share across one event loop."""

    def __init__(
        self,
        redis: Any,
        settings: AuditSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.settings = settings or AuditSettings()
        self._clock = clock

    async def record(
        self,
        actor: Actor,
        action: str,
        target: str,
        *,
        tenant_id: str | None = None,
        before: Any = None,
        after: Any = None,
    ) -> None:
        """Log and append one entry. A failed Redis write is logged, never raised: the change
        it describes has already happened, and the log line has already been written."""
        now = self._clock()
        fields = {
            "time": f"{now:.3f}",
            "actor": actor.name,
            "actor_kind": actor.kind,
            "address": actor.address,
            "request_id": actor.request_id or "",
            "action": action,
            "target": target,
            "tenant_id": tenant_id or "",
            "before": json.dumps(scrub(before), sort_keys=True),
            "after": json.dumps(scrub(after), sort_keys=True),
        }
        log.info(json.dumps({"event": "admin_change", **_decoded(fields)}, sort_keys=True))
        retention = self.settings
        args: list[Any] = [int(retention.retention_days * 86400 * 1000), retention.max_entries]
        for name, value in fields.items():
            args += [name, value]
        try:
            await self.redis.eval(_APPEND, 1, STREAM_KEY, *args)
        except RedisError as exc:
            log.error("audit: could not append %s %s to Redis (%s)", action, target, exc)

    async def read(
        self,
        *,
        limit: int = 50,
        before: str | None = None,
        actor: str | None = None,
        action: str | None = None,
        tenant_id: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> tuple[list[AuditEntry], str | None]:
        """Newest first: up to ``limit`` entries older than the cursor ``before`` (a stream
        id) that match every filter given (``action`` matches exactly or as a prefix ending in
        a dot, e.g. ``tenant.``). Returns the entries and the cursor of the next page (None:
        no more). One call scans at most :data:`MAX_SCAN` entries, so with a filter that
        matches rarely a page may hold fewer than ``limit`` entries and still have a cursor."""
        limit = max(1, min(limit, MAX_PAGE))
        if before is not None and _is_first_id(before):
            return [], None  # nothing is older; Redis refuses an exclusive range ending at 0-0
        high = f"({before}" if before else ("+" if until is None else f"{int(until * 1000)}")
        low = "-" if since is None else f"{int(since * 1000)}"
        found: list[AuditEntry] = []
        scanned = 0
        while True:
            batch = await self.redis.xrevrange(STREAM_KEY, high, low, count=SCAN_BATCH)
            scanned += len(batch)
            for raw_id, raw in batch:
                entry = _entry(raw_id, raw)
                if _matches(entry, actor, action, tenant_id):
                    found.append(entry)
                    if len(found) == limit:
                        return found, entry.id
            if len(batch) < SCAN_BATCH:
                return found, None
            last = _text(batch[-1][0])
            if scanned >= MAX_SCAN:
                return found, last
            high = f"({last}"


def _is_first_id(stream_id: str) -> bool:
    """Is ``stream_id`` (``ms-seq``, checked by the route) the least id a stream can hold?"""
    ms, _, seq = stream_id.partition("-")
    return int(ms or 0) == 0 and int(seq or 0) == 0


def _matches(
    entry: AuditEntry, actor: str | None, action: str | None, tenant_id: str | None
) -> bool:
    if actor is not None and entry.actor != actor:
        return False
    if tenant_id is not None and entry.tenant_id != tenant_id:
        return False
    if action is not None:
        if action.endswith("."):
            return entry.action.startswith(action)
        return entry.action == action
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decoded(fields: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(fields)
    out["time"] = float(fields["time"])
    out["before"] = json.loads(fields["before"])
    out["after"] = json.loads(fields["after"])
    out["request_id"] = fields["request_id"] or None
    out["tenant_id"] = fields["tenant_id"] or None
    return out


def _entry(raw_id: bytes | str, raw: Mapping[Any, Any]) -> AuditEntry:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return AuditEntry(id=_text(raw_id), **_decoded(fields))


def entry_json(entry: AuditEntry) -> dict[str, Any]:
    return {"object": "audit_entry", **asdict(entry)}
