"""The OpenAI Batch API's records, per tenant, in the gateway's Redis; and what a batch line is.

A batch is one Redis string ``portico:batches:{tenant}:<id>`` (the batch object OpenAI returns,
without its counts), listed in the tenant's sorted set ``portico:batches:{tenant}``; the
tenant's batches not yet finished are the set ``portico:batches_active:{tenant}`` (the
``max_batches_per_tenant`` limit counts it). Each line's result is kept as it is known, in one
of two hashes (``portico:batch_out:{tenant}:<id>`` for answers, ``portico:batch_err:...`` for
errors) under the line's index: a Lua script writes a line's result only if neither hash has
one yet, so a line is recorded once however often it is offered, and ``request_counts`` are the
two hashes' lengths. Batches with work left are also members of one global set
(``portico:batch_queue``), which a starting gateway reads to resume them; a lease per batch
(``portico:batch_lease:{tenant}:<id>``, renewed while it runs) lets only one runner feed it.
Every key of one script or transaction shares the tenant's hash tag (Redis Cluster).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.batch.s3_storage import S3StoreSettings
from gateway.relay.responses_store import page_limit
from gateway.store import RedisClient
from portico.errors import InvalidRequestError, NotFoundError, RateLimitError

# the endpoints a batch may name, and the request kind each is served as
BATCH_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/responses": "responses",
}
TERMINAL = ("completed", "failed", "expired", "cancelled")
QUEUE_KEY = "portico:batch_queue"
_BATCH_ID = re.compile(r"^batch_[A-Za-z0-9]{1,64}$")
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}

# KEYS: the line's answers hash, its errors hash; ARGV: the line index, "out" or "err", the line
_RECORD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
then return 0 end
if ARGV[2] == 'out' then redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
else redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
return 1
"""

# KEYS: the tenant's active set, the batch, its state, the tenant's index;
# ARGV: limit, id, json, the listing's score (creation time)
_CREATE = """
if tonumber(ARGV[1]) > 0 and redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[3], 'status', 'validating')
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
return 1
"""

# KEYS: the batch's state; ARGV: the statuses it may be in (comma-separated), then field/value
# pairs to set. A status change is a compare-and-set, so a cancel and the runner never undo
# each other.
_TRANSITION = """
local now = redis.call('HGET', KEYS[1], 'status')
if not now then return 0 end
local allowed = false
for s in string.gmatch(ARGV[1], '[^,]+') do if s == now then allowed = true end end
if not allowed then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
_STATE_INTS = (
    "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at",
)  # fmt: skip


class BatchSettings(BaseModel):
    """The Files and Batch APIs: where files live, the limits, and the runner's pace."""

    model_config = ConfigDict(extra="forbid")

    files_dir: Path | None = None  # None: <redis.data_dir>/files
    # None: file bytes on disk under files_dir; {kind: s3, ...}: in an S3-compatible bucket
    store: S3StoreSettings | None = None
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024)  # OpenAI: 200 MB
    max_lines_per_batch: int = Field(default=50_000, ge=1)  # OpenAI: 50,000
    max_batches_per_tenant: int = Field(default=10, ge=1)  # not yet finished, at once
    # lines in flight at once, over all batches this gateway runs
    max_concurrency: int = Field(default=4, ge=1, le=1024)
    run: bool = True  # false: this replica serves the APIs but runs no batch
    lease_s: float = Field(default=15.0, ge=1, le=600)  # a dead runner's batch waits this long
    scan_interval_s: float = Field(default=5.0, gt=0, le=600)  # how often the queue is read

    @model_validator(mode="after")
    def _one_storage(self) -> BatchSettings:
        if self.store is not None and self.files_dir is not None:
            raise ValueError("files_dir is where files live without a store: set one of them")
        return self


def batch_key(tenant_id: str, batch_id: str) -> str:
    return f"portico:batches:{{{tenant_id}}}:{batch_id}"


def state_key(tenant_id: str, batch_id: str) -> str:
    return f"portico:batch_state:{{{tenant_id}}}:{batch_id}"


def _result_keys(tenant_id: str, batch_id: str) -> tuple[str, str]:
    return (
        f"portico:batch_out:{{{tenant_id}}}:{batch_id}",
        f"portico:batch_err:{{{tenant_id}}}:{batch_id}",
    )


def lease_key(tenant_id: str, batch_id: str) -> str:
    return f"portico:batch_lease:{{{tenant_id}}}:{batch_id}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def completion_window_s(window: object) -> int:
    """``"24h"`` (OpenAI's one value) or another ``<n>s|m|h`` up to 24 hours, in seconds."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 0 < seconds <= 24 * 3600:
        raise InvalidRequestError(
            "Invalid value for 'completion_window': '24h' (or a shorter '<n>h', '<n>m', '<n>s').",
            param="completion_window",
        )
    return seconds


@dataclass(frozen=True)
class Owner:
    """Whose batch: the tenant and the credential it was created with (a key id, or a JWT
    subject), which the runner resolves to a principal again before each run."""

    tenant_id: str
    key_id: str | None
    subject: str | None


class BatchStore:
    """Batch records, their states, line results, the queue and the leases in Redis.

    A batch is two keys: what never changes (``batch_key``: the request, the owner, the line
    count) and its state (``state_key``, a hash: status, timestamps, result files), which
    changes only by compare-and-set (:meth:`transition`)."""

    def __init__(self, redis: RedisClient) -> None:
        self.redis = redis
        self._record = redis.register_script(_RECORD)
        self._create = redis.register_script(_CREATE)
        self._transition = redis.register_script(_TRANSITION)

    async def create(
        self, owner: Owner, fields: Mapping[str, Any], num_lines: int, limit: int
    ) -> dict[str, Any]:
        """A new batch in ``validating``; a 429 when the tenant has ``limit`` unfinished."""
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        record: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": fields["endpoint"],
            "input_file_id": fields["input_file_id"],
            "completion_window": fields["completion_window"],
            "created_at": now,
            "expires_at": now + fields["window_s"],
            "metadata": fields.get("metadata"),
            "total": num_lines,
            "owner": {"key_id": owner.key_id, "subject": owner.subject},
        }
        tenant = owner.tenant_id
        keys = [
            f"portico:batches_active:{{{tenant}}}",
            batch_key(tenant, batch_id),
            state_key(tenant, batch_id),
            f"portico:batches:{{{tenant}}}",
        ]
        # listed newest first by creation time to the microsecond (seconds would tie)
        args: list[str | int] = [limit, batch_id, json.dumps(record), repr(time.time())]
        if not await self._create(keys=keys, args=args):
            raise RateLimitError(
                f"The tenant has {limit} batches not yet finished, the most it may have.",
                code="batch_limit_reached",
            )
        await self.redis.sadd(QUEUE_KEY, f"{tenant}/{batch_id}")
        return await self.view(tenant, batch_id)

    async def load(self, tenant_id: str, batch_id: str) -> dict[str, Any]:
        """The batch's record with its state merged in (``status`` and the rest), or a 404
        (also for another tenant's id)."""
        raw, state = None, {}
        if _BATCH_ID.match(batch_id):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.get(batch_key(tenant_id, batch_id))
                pipe.hgetall(state_key(tenant_id, batch_id))
                raw, state = await pipe.execute()
        if raw is None:
            raise NotFoundError(
                f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found"
            )
        batch: dict[str, Any] = json.loads(raw)
        for name, value in state.items():
            batch[_text(name)] = _text(value)
        return batch

    async def view(self, tenant_id: str, batch_id: str) -> dict[str, Any]:
        """The batch object as OpenAI returns it (live counts while it runs)."""
        return await self.public(tenant_id, await self.load(tenant_id, batch_id))

    async def public(self, tenant_id: str, batch: Mapping[str, Any]) -> dict[str, Any]:
        if "counts" in batch:  # finished: the counts it finished with
            completed, failed = json.loads(batch["counts"])
        else:
            completed, failed = await self.counts(tenant_id, batch["id"])
        view: dict[str, Any] = {
            "id": batch["id"],
            "object": "batch",
            "endpoint": batch["endpoint"],
            "errors": json.loads(batch["errors"]) if "errors" in batch else None,
            "input_file_id": batch["input_file_id"],
            "completion_window": batch["completion_window"],
            "status": batch["status"],
            "output_file_id": batch.get("output_file_id"),
            "error_file_id": batch.get("error_file_id"),
            "created_at": batch["created_at"],
            "expires_at": batch["expires_at"],
        }
        for name in _STATE_INTS:
            view[name] = int(batch[name]) if name in batch else None
        view["request_counts"] = {
            "total": batch["total"],
            "completed": completed,
            "failed": failed,
        }
        view["metadata"] = batch["metadata"]
        return view

    async def transition(
        self, tenant_id: str, batch_id: str, allowed: tuple[str, ...], **changes: Any
    ) -> bool:
        """Set ``changes`` (status, timestamps, file ids) if the batch's status is one of
        ``allowed``; False when it is not (another writer moved it first)."""
        args: list[Any] = [",".join(allowed)]
        for name, value in changes.items():
            args += [name, value]
        keys = [state_key(tenant_id, batch_id)]
        return bool(await self._transition(keys=keys, args=args))

    async def finish(self, tenant_id: str, batch_id: str) -> None:
        """A batch now in a terminal status: drop its line results, take it off the queue."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(f"portico:batches_active:{{{tenant_id}}}", batch_id)
            pipe.delete(*_result_keys(tenant_id, batch_id))
            await pipe.execute()
        await self.redis.srem(QUEUE_KEY, f"{tenant_id}/{batch_id}")

    async def page(self, tenant_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/batches``: newest first, ``limit`` 1-100 (default 20), ``after`` an id."""
        limit = page_limit(query)
        index = f"portico:batches:{{{tenant_id}}}"
        ids = [_text(i) for i in await self.redis.zrevrange(index, 0, -1)]
        after = query.get("after")
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        data = []
        for batch_id in ids[:limit]:
            try:
                data.append(await self.view(tenant_id, batch_id))
            except NotFoundError:
                continue
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ids) > limit,
        }

    # ------------------------------------------------------------------ line results

    async def record(self, tenant_id: str, batch_id: str, index: int, ok: bool, line: str) -> bool:
        """Keep line ``index``'s result unless it has one; True when this call kept it."""
        keys = list(_result_keys(tenant_id, batch_id))
        return bool(await self._record(keys=keys, args=[index, "out" if ok else "err", line]))

    async def done_lines(self, tenant_id: str, batch_id: str) -> set[int]:
        out, err = _result_keys(tenant_id, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hkeys(out)
            pipe.hkeys(err)
            found = await pipe.execute()
        return {int(i) for keys in found for i in keys}

    async def results(self, tenant_id: str, batch_id: str) -> list[dict[int, str]]:
        """Every recorded line: [answers, errors], each by line index."""
        out, err = _result_keys(tenant_id, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(out)
            pipe.hgetall(err)
            found = await pipe.execute()
        return [{int(k): _text(v) for k, v in h.items()} for h in found]

    async def counts(self, tenant_id: str, batch_id: str) -> tuple[int, int]:
        out, err = _result_keys(tenant_id, batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hlen(out)
            pipe.hlen(err)
            completed, failed = await pipe.execute()
        return int(completed), int(failed)

    # ------------------------------------------------------------------ queue and leases

    async def queued(self) -> list[tuple[str, str]]:
        """Every (tenant, batch id) with work left, oldest first by id order."""
        found = []
        for member in await self.redis.smembers(QUEUE_KEY):
            tenant, _, batch_id = _text(member).rpartition("/")
            found.append((tenant, batch_id))
        return sorted(found)

    async def take_lease(self, tenant_id: str, batch_id: str, owner: str, ttl_s: float) -> bool:
        """Hold the batch's lease (take it, or renew our own); False: another runner has it."""
        key = lease_key(tenant_id, batch_id)
        ttl_ms = int(ttl_s * 1000)
        if await self.redis.set(key, owner, nx=True, px=ttl_ms):
            return True
        held = await self.redis.get(key)
        if held is not None and _text(held) == owner:
            await self.redis.pexpire(key, ttl_ms)
            return True
        return False

    async def drop_lease(self, tenant_id: str, batch_id: str, owner: str) -> None:
        key = lease_key(tenant_id, batch_id)
        held = await self.redis.get(key)
        if held is not None and _text(held) == owner:
            await self.redis.delete(key)


# ---------------------------------------------------------------------- lines


@dataclass(frozen=True)
class BatchLine:
    """One well-formed input line: its index, ``custom_id`` and the request body to send."""

    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """A line that cannot be sent, with the error that goes to the error file."""

    index: int
    custom_id: str | None
    code: str
    message: str


def read_lines(content: bytes) -> list[bytes]:
    """The file's non-blank lines (a trailing newline, blank lines and CRLF ignored)."""
    return [line for line in content.splitlines() if line.strip()]


def parse_line(index: int, raw: bytes, endpoint: str, model: str | None) -> BatchLine | LineError:
    """Check one line as OpenAI does: a JSON object with a string ``custom_id``, ``method``
    POST, ``url`` the batch's endpoint and an object ``body`` naming the batch's ``model``
    (the first well-formed line's), not streamed. What the request path checks (parameters,
    the model being served and allowed) it checks when the line is sent."""
    try:
        line = json.loads(raw)
    except ValueError as exc:
        return LineError(index, None, "invalid_json_line", f"Line {index + 1} is not JSON: {exc}")
    if not isinstance(line, dict):
        return LineError(index, None, "invalid_json_line", "A line must be a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(index, None, "missing_custom_id", "A line needs a string 'custom_id'.")
    if line.get("method", "POST") != "POST":
        return LineError(index, custom_id, "invalid_method", "A line's 'method' must be POST.")
    if line.get("url") != endpoint:
        return LineError(
            index,
            custom_id,
            "invalid_url",
            f"The line's 'url' {line.get('url')!r} is not the batch's endpoint {endpoint!r}.",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        return LineError(index, custom_id, "invalid_body", "A line's 'body' must be an object.")
    if model is not None and body.get("model") != model:
        return LineError(
            index,
            custom_id,
            "model_mismatch",
            f"The line's model {body.get('model')!r} is not the batch's model {model!r}: "
            "every line of a batch must use the same model.",
        )
    if body.get("stream"):
        return LineError(index, custom_id, "invalid_body", "Batch lines cannot be streamed.")
    return BatchLine(index, custom_id, body)


def batch_model(lines: list[bytes]) -> str | None:
    """The batch's model: the first line that is an object with a string ``body.model``."""
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        body = line.get("body") if isinstance(line, dict) else None
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            return str(body["model"])
    return None


def output_line(custom_id: str | None, status: int, request_id: str, body: Any) -> str:
    """A line of the output or error file for an answered request (OpenAI's format)."""
    return json.dumps(
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """A line of the error file for a request that was never answered."""
    return json.dumps(
        {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )
