"""Usage per tenant, per model, per UTC day: counted in Redis, read back by the admin API.

Layout: ``portico:usage:{<tenant_id>}:<YYYY-MM-DD>`` (:func:`gateway.identity.layout.usage_key`,
hash-tagged by tenant) is a hash of counters (``requests``, ``prompt_tokens``,
``completion_tokens``, and when the gateway counted a request's output itself because its
upstream reported no usage, ``requests_counted_tokenizer`` or ``requests_counted_estimate``;
each also as ``<model>|<counter>`` per model), expiring after 400 days. The gateway adds to it
in batches (``gateway/admission/usage_recorder.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
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
    "completion_tokens",
    "requests_counted_tokenizer",
    "requests_counted_estimate",
)


def usage_fields(
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    requests: int = 1,
    counted_tokenizer: int = 0,
    counted_estimate: int = 0,
) -> dict[str, int]:
    """The usage hash fields that ``requests`` finished requests with these token totals add
    (totals and the model's twins); the counted-by-the-gateway counters only when not zero."""
    out: dict[str, int] = {}
    for field, amount in (
        ("requests", requests),
        ("prompt_tokens", prompt_tokens),
        ("completion_tokens", completion_tokens),
        ("requests_counted_tokenizer", counted_tokenizer),
        ("requests_counted_estimate", counted_estimate),
    ):
        if amount or field in ("requests", "prompt_tokens", "completion_tokens"):
            out[field] = amount
            out[f"{model}|{field}"] = amount
    return out


class UsageCounters(BaseModel):
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # requests whose output tokens the gateway counted itself (no usage from the upstream):
    # with the model's tokenizer, or by the provider's rule (~4 characters per token)
    requests_counted_tokenizer: int = 0
    requests_counted_estimate: int = 0


class DayUsage(UsageCounters):
    date: str
    models: dict[str, UsageCounters] = Field(default_factory=dict)


class TenantUsage(BaseModel):
    """Usage of one tenant over ``[start, end]`` (UTC days); days without traffic omitted."""

    tenant_id: str
    start: str
    end: str
    totals: UsageCounters
    models: dict[str, UsageCounters]
    days: list[DayUsage]


def _add(target: UsageCounters, prompt: int, completion: int, requests: int) -> None:
    target.requests += requests
    target.prompt_tokens += prompt
    target.completion_tokens += completion
    target.total_tokens += prompt + completion


def _add_counted(target: UsageCounters, source: UsageCounters) -> None:
    target.requests_counted_tokenizer += source.requests_counted_tokenizer
    target.requests_counted_estimate += source.requests_counted_estimate


class UsageLedger:
    """The usage counters of every tenant over one Redis client (a server's or a cluster's).

    Writes are pipelined ``HINCRBY`` (commutative, so concurrent writers from any number of
    replicas never lose a count; not a transaction, so a cluster pipeline may spread a batch
    over its nodes); reads return whole days (one tenant's days share its slot).
    """

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis

    async def record_usage(
        self, tenant_id: str, model: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Count one finished request (one pipelined round trip; per UTC day)."""
        day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        await self.add_usage(
            {(tenant_id, day): usage_fields(model, prompt_tokens, completion_tokens)}
        )

    async def add_usage(self, counts: Mapping[tuple[str, str], Mapping[str, int]]) -> None:
        """Add summed usage fields per ``(tenant_id, "YYYY-MM-DD")`` in one pipelined round trip.

        The fields are those of :func:`usage_fields` (``requests``, ``prompt_tokens``,
        ``completion_tokens`` and their ``<model>|<counter>`` twins), so a batch of many
        requests (see ``gateway/admission/usage_recorder.py``) lands exactly as they would one
        by one.
        """
        pipe = self.redis.pipeline(transaction=False)
        for (tenant_id, day), fields in counts.items():
            key = usage_key(tenant_id, day)
            for field, amount in fields.items():
                pipe.hincrby(key, field, amount)
            pipe.expire(key, USAGE_TTL_SECONDS)
        await pipe.execute()

    async def usage(self, tenant_id: str, start: date, end: date) -> TenantUsage:
        if end < start:
            raise InvalidRequestError("'end' is before 'start'.", param="end")
        num_days = (end - start).days + 1
        if num_days > MAX_USAGE_DAYS:
            raise InvalidRequestError(f"At most {MAX_USAGE_DAYS} days per query.", param="end")
        days = [start + timedelta(days=i) for i in range(num_days)]
        pipe = self.redis.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(usage_key(tenant_id, day.isoformat()))
        rows = await pipe.execute()
        totals = UsageCounters()
        per_model: dict[str, UsageCounters] = {}
        out: list[DayUsage] = []
        for day, row in zip(days, rows, strict=True):
            if not row:
                continue
            counts = {k.decode(): int(v) for k, v in row.items()}
            entry = DayUsage(date=day.isoformat())
            _add(
                entry,
                counts.get("prompt_tokens", 0),
                counts.get("completion_tokens", 0),
                counts.get("requests", 0),
            )
            entry.requests_counted_tokenizer = counts.get("requests_counted_tokenizer", 0)
            entry.requests_counted_estimate = counts.get("requests_counted_estimate", 0)
            for field, value in counts.items():
                model, sep, counter = field.rpartition("|")
                if not sep or counter not in USAGE_COUNTERS:
                    continue
                slot = entry.models.setdefault(model, UsageCounters())
                setattr(slot, counter, getattr(slot, counter) + value)
            for model, slot in entry.models.items():
                slot.total_tokens = slot.prompt_tokens + slot.completion_tokens
                into = per_model.setdefault(model, UsageCounters())
                _add(into, slot.prompt_tokens, slot.completion_tokens, slot.requests)
                _add_counted(into, slot)
            _add(totals, entry.prompt_tokens, entry.completion_tokens, entry.requests)
            _add_counted(totals, entry)
            out.append(entry)
        return TenantUsage(
            tenant_id=tenant_id,
            start=start.isoformat(),
            end=end.isoformat(),
            totals=totals,
            models=per_model,
            days=out,
        )
