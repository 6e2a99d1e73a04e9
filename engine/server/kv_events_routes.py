"""``GET /v1/kv_events`` and ``GET /v1/kv_events/snapshot``: the prefix cache's block events
for the gateway's prefix-aware replica choice (gateway/fleet/prefix_index.py).

Why HTTP polling on the engine's own socket, not ZeroMQ or Redis streams: the gateway already
holds one connection pool per replica on the loopback port or Unix socket it supervises (and the
NetworkPolicy admits only it on Kubernetes), so the events need no new port, no new dependency
and no broker between two processes on one host; the same ``--api-key`` guards them. A poll
every few hundred milliseconds costs one small request, and an index a poll old is as good as
a pushed one for routing (a miss only costs a prefill). A Redis stream would put every block
of every engine through the shared Redis that admission depends on.

The snapshot also carries the engine's block size and the root of its hash chain: with them
and the request's tokens and salt, the gateway computes the same block hashes
(:func:`engine.kv_cache_manager.prefix_block_hashes`). Only a gateway can reach these routes,
and the tenants' salts, which the gateway alone derives, keep one tenant's hashes out of
another's reach; the root does not weaken that.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from engine.async_engine import AsyncLLMEngine
from engine.kv_events import KVEvent, KVEventLog
from portico.errors import InvalidRequestError

MAX_EVENTS_PER_POLL = 4096


def _int_param(request: Request, name: str, default: int, minimum: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise InvalidRequestError(
            f"'{name}' must be an integer >= {minimum}, got {raw!r}.", param=name
        )
    return value


def _grouped(events: list[KVEvent]) -> list[dict[str, Any]]:
    """Consecutive events of one kind as one entry (``seq`` is its first event's)."""
    out: list[dict[str, Any]] = []
    for event in events:
        if out and out[-1]["type"] == event.kind and event.kind != "cleared":
            out[-1]["hashes"].append(event.block_hash.hex())
            continue
        hashes = [event.block_hash.hex()] if event.block_hash else []
        out.append({"seq": event.seq, "type": event.kind, "hashes": hashes})
    return out


def add_kv_event_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Mount the two routes for the engine's event log (prefix caching on: it has one).

    Each poll also carries the engine's load as of its latest step (``num_waiting``,
    ``num_running``, ``kv_cache_usage``) and its LoRA adapters (``lora_adapters``: name ->
    the number its block hashes carry; ``lora_resident``: those in a slot now), so one request
    feeds a router every part of its score.
    """
    kv = engine.engine.scheduler.kv
    lora = engine.engine.lora
    log: KVEventLog | None = kv.events
    if log is None:
        return

    @app.get("/v1/kv_events")
    async def kv_events(request: Request) -> dict[str, Any]:
        since = _int_param(request, "since", 1, 1)
        limit = min(_int_param(request, "limit", MAX_EVENTS_PER_POLL, 1), MAX_EVENTS_PER_POLL)
        batch = log.since(since, limit)
        stats = engine.stats()
        return {
            "epoch": batch.epoch,
            "next_seq": batch.next_seq,
            "resync": batch.resync,
            "events": _grouped(batch.events),
            "num_waiting": stats.num_waiting + stats.num_swapped,
            "num_running": stats.num_running,
            "kv_cache_usage": stats.kv_cache_usage,
            "lora_adapters": lora.registered_ids() if lora is not None else {},
            "lora_resident": list(stats.resident_lora_adapters),
        }

    @app.get("/v1/kv_events/snapshot")
    async def kv_events_snapshot() -> dict[str, Any]:
        snap = log.snapshot()
        return {
            "epoch": snap.epoch,
            "next_seq": snap.next_seq,
            "block_size": kv.block_size,
            "hash_root": kv.root_hash.hex(),
            "hashes": [h.hex() for h in snap.hashes],
        }
