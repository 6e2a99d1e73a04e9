"""Usage per tenant, per model, per UTC day: counted in Redis, read back by the admin API.

Layout: ``portico:usage:{<tenant_id>}:<YYYY-MM-DD>`` (:func:`gateway.identity.layout.usage_key`,
hash-tagged by tenant) is a hash of counters (``requests``, ``prompt_tokens``,
``cached_tokens`` (the part of the prompt read from the engine's prefix cache),
``completion_tokens``, ``spend_micro_usd`` (integer micro-dollars at the model's price), and when
the gateway counted a request's output itself because its upstream reported no usage,
``requests_counted_tokenizer`` or ``requests_counted_estimate``; each also as
``<model>|<counter>`` per model, and the first five as ``k:<key_id>|<model>|<counter>`` per API
key and model), expiring after 400 days. The gateway adds to it in batches
(``gateway/admission/usage_recorder.py``). Requests of callers without an API key (JWT, admin)
and those recorded before the per-key fields existed are the model's counts less its keys'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import date, datetime, timedelta, timezone

from pydantic import BaseModel, Field

from gateway.identity.layout import usage_key
from gateway.store import RedisClient
from portico.errors import InvalidRequestError

USAGE_TTL_SECONDS = 400 * 86400
MAX_USAGE_DAYS = 366
USAGE_COUNTERS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "spend_micro_usd",
    "requests_counted_tokenizer",
    "requests_counted_estimate",
)
KEY_COUNTERS = USAGE_COUNTERS[:5]  # per key and model: what an invoice line needs
KEY_FIELD_PREFIX = "k:"


def usage_fields(
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    requests: int = 1,
    counted_tokenizer: int = 0,
    counted_estimate: int = 0,
    *,
    cached_tokens: int = 0,
    spend_micro_usd: int = 0,
    key_id: str | None = None,
) -> dict[str, int]:
    """The usage hash fields that ``requests`` finished requests with these totals add (totals,
    the model's twins and, with a ``key_id``, the key and model's); a counter other than
    requests, prompt and completion tokens only when not zero."""
    out: dict[str, int] = {}
    for name, amount in (
        ("requests", requests),
        ("prompt_tokens", prompt_tokens),
        ("cached_tokens", cached_tokens),
        ("completion_tokens", completion_tokens),
        ("spend_micro_usd", spend_micro_usd),
        ("requests_counted_tokenizer", counted_tokenizer),
        ("requests_counted_estimate", counted_estimate),
    ):
        if amount or name in ("requests", "prompt_tokens", "completion_tokens"):
            out[name] = amount
            out[f"{model}|{name}"] = amount
            if key_id is not None and name in KEY_COUNTERS:
                out[f"{KEY_FIELD_PREFIX}{key_id}|{model}|{name}"] = amount
    return out


class UsageCounters(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    # of prompt_tokens, those the engine read from its prefix cache (priced at cached_input)
    cached_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # exact, in integer micro-dollars; spend_usd is the same amount in dollars
    spend_micro_usd: int = 0
    spend_usd: float = 0.0
    # requests whose output tokens the gateway counted itself (no usage from the upstream):
    # with the model's tokenizer, or by the provider's rule (~4 characters per token)
    requests_counted_tokenizer: int = 0
    requests_counted_estimate: int = 0

    def add(self, other: UsageCounters) -> None:
        for name in USAGE_COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.complete()

    def complete(self) -> None:
        """Set the derived fields (total tokens, spend in dollars) from the counters."""
        self.total_tokens = self.prompt_tokens + self.completion_tokens
        self.spend_usd = self.spend_micro_usd / 1_000_000


class KeyUsage(UsageCounters):
    """One API key's usage, with its split per model."""

    models: dict[str, UsageCounters] = Field(default_factory=dict)


class DayUsage(UsageCounters):
    date: str
    models: dict[str, UsageCounters] = Field(default_factory=dict)
    keys: dict[str, UsageCounters] = Field(default_factory=dict)


class TenantUsage(BaseModel):
    """Usage of one tenant over ``[start, end]`` (UTC days); days without traffic omitted.
    ``keys`` holds the requests made with API keys (JWT and admin callers have none)."""

    tenant_id: str
    start: str
    end: str
    totals: UsageCounters
    models: dict[str, UsageCounters]
    keys: dict[str, KeyUsage] = Field(default_factory=dict)
    days: list[DayUsage]


@dataclass(slots=True)
class DayRecord:
    """One tenant's usage hash of one day, parsed: totals, per model, per (key, model)."""

    totals: UsageCounters = dataclass_field(default_factory=UsageCounters)
    models: dict[str, UsageCounters] = dataclass_field(default_factory=dict)
    cells: dict[tuple[str, str], UsageCounters] = dataclass_field(default_factory=dict)

    def rows(self) -> list[tuple[str | None, str, UsageCounters]]:
        """(key id or None, model, counters) per key and model, sorted; the model's requests
        no key accounts for (JWT or admin callers, older records) under ``None``."""
        out: list[tuple[str | None, str, UsageCounters]] = []
        for model in sorted(self.models):
            cells = sorted((k, c) for (k, m), c in self.cells.items() if m == model)
            rest = UsageCounters()
            for name in KEY_COUNTERS:
                keyed = sum(getattr(c, name) for _, c in cells)
                setattr(rest, name, getattr(self.models[model], name) - keyed)
            if any(getattr(rest, name) > 0 for name in KEY_COUNTERS):
                rest.complete()
                out.append((None, model, rest))
            out.extend((key_id, model, counters) for key_id, counters in cells)
        return out


def parse_day(row: Mapping[bytes, bytes]) -> DayRecord:
    """A usage hash (HGETALL) as a :class:`DayRecord`; unknown fields are ignored."""
    record = DayRecord()
    for raw_field, raw_value in row.items():
        name = raw_field.decode()
        value = int(raw_value)
        parts = name.split("|")
        counter = parts[-1]
        if counter not in USAGE_COUNTERS:
            continue
        if len(parts) == 1:
            target = record.totals
        elif len(parts) == 2:
            target = record.models.setdefault(parts[0], UsageCounters())
        elif len(parts) == 3 and parts[0].startswith(KEY_FIELD_PREFIX):
            cell = (parts[0][len(KEY_FIELD_PREFIX) :], parts[1])
            target = record.cells.setdefault(cell, UsageCounters())
        else:
            continue
        setattr(target, counter, getattr(target, counter) + value)
    record.totals.complete()
    for counters in (*record.models.values(), *record.cells.values()):
        counters.complete()
    return record


class UsageLedger:
    """The usage counters of every tenant over one Redis client (a server's or a cluster's).

    Writes are pipelined ``HINCRBY`` (commutative, so concurrent writers from any number of
    replicas never lose a count; not a transaction, so a cluster pipeline may spread a batch
    over its nodes); reads return whole days (one tenant's days share its slot).
    """

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    async def record_usage(
        self,
        tenant_id: str,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached_tokens: int = 0,
        spend_micro_usd: int = 0,
        key_id: str | None = None,
        day: str | None = None,
    ) -> None:
        """Count one finished request (one pipelined round trip; per UTC day, today unless
        ``day`` names one)."""
        day = day or datetime.now(timezone.utc).strftime("%Y-%m-%d")
        fields = usage_fields(
            model,
            prompt_tokens,
            completion_tokens,
            cached_tokens=cached_tokens,
            spend_micro_usd=spend_micro_usd,
            key_id=key_id,
        )
        await self.add_usage({(tenant_id, day): fields})

    async def add_usage(self, counts: Mapping[tuple[str, str], Mapping[str, int]]) -> None:
        """Add summed usage fields per ``(tenant_id, "YYYY-MM-DD")`` in one pipelined round trip.

        The fields are those of :func:`usage_fields` (``requests``, ``prompt_tokens``,
        ``completion_tokens`` and their ``<model>|<counter>`` twins), so a batch of many
        requests (see ``gateway/admission/usage_recorder.py``) lands exactly as they would one
        by one.
        """
        pipe = self.redis.pipeline(transaction=False)
        for command in usage_commands(counts):
            pipe.execute_command(*command)
        await pipe.execute()

    async def days(self, tenant_id: str, start: date, end: date) -> list[tuple[date, DayRecord]]:
        """The tenant's parsed usage of every day in ``[start, end]`` that has any (one
        pipelined round trip). Raises InvalidRequestError for a reversed or too long range."""
        check_range(start, end)
        days = [start + timedelta(days=i) for i in range((end - start).days + 1)]
        pipe = self.redis.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(usage_key(tenant_id, day.isoformat()))
        rows = await pipe.execute()
        return [(day, parse_day(row)) for day, row in zip(days, rows, strict=True) if row]

    async def usage(self, tenant_id: str, start: date, end: date) -> TenantUsage:
        totals = UsageCounters()
        per_model: dict[str, UsageCounters] = {}
        per_key: dict[str, KeyUsage] = {}
        out: list[DayUsage] = []
        for day, record in await self.days(tenant_id, start, end):
            entry = DayUsage(date=day.isoformat(), models=record.models)
            entry.add(record.totals)
            for model, counters in record.models.items():
                per_model.setdefault(model, UsageCounters()).add(counters)
            for (key_id, model), counters in record.cells.items():
                entry.keys.setdefault(key_id, UsageCounters()).add(counters)
                key_usage = per_key.setdefault(key_id, KeyUsage())
                key_usage.add(counters)
                key_usage.models.setdefault(model, UsageCounters()).add(counters)
            totals.add(record.totals)
            out.append(entry)
        return TenantUsage(
            tenant_id=tenant_id,
            start=start.isoformat(),
            end=end.isoformat(),
            totals=totals,
            models=per_model,
            keys=per_key,
            days=out,
        )


def check_range(start: date, end: date) -> None:
    """Raise InvalidRequestError unless ``[start, end]`` is a range of at most
    ``MAX_USAGE_DAYS`` days."""
    if end < start:
        raise InvalidRequestError("'end' is before 'start'.", param="end")
    if (end - start).days + 1 > MAX_USAGE_DAYS:
        raise InvalidRequestError(f"At most {MAX_USAGE_DAYS} days per query.", param="end")


def usage_commands(
    counts: Mapping[tuple[str, str], Mapping[str, int]],
) -> list[tuple[str | int, ...]]:
    """The Redis commands that add ``counts`` (see :meth:`UsageLedger.add_usage`): an
    ``HINCRBY`` per field and an ``EXPIRE`` per day's hash, in that order."""
    commands: list[tuple[str | int, ...]] = []
    for (tenant_id, day), fields in counts.items():
        key = usage_key(tenant_id, day)
        for field, amount in fields.items():
            commands.append(("HINCRBY", key, field, amount))
        commands.append(("EXPIRE", key, USAGE_TTL_SECONDS))
    return commands
