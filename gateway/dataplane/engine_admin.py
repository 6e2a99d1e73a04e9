"""``GET /admin/v1/engines``: the state of every local engine replica, as JSON.

What the supervisor knows (state, pid, restarts), what the pool knows (up, ejected, requests
outstanding from this gateway) and what the replica's own ``/metrics`` says now (requests
running and waiting, KV cache usage, preemptions), the same scrape ``/metrics/engines`` does.
A replica whose metrics do not answer shows ``metrics: null``. Admin credential only, checked
like the rest of the admin API. The console's engines page reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from gateway.dataplane.engine_metrics import fetch_exposition
from gateway.dataplane.pool import Pool, Replica
from gateway.dataplane.supervisor import Supervisor
from gateway.identity.principal import Principal

# engine metric name -> field of the answer (vLLM's names, engine/server/metrics.py)
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_preemptions": "preemptions",
}


def engine_gauges(text: str) -> dict[str, float]:
    """The :data:`GAUGES` of one exposition, summed over label sets (one per served model)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = GAUGES.get(sample.name) or GAUGES.get(family.name)
            if name is not None and sample.name in (family.name, f"{family.name}_total"):
                out[name] = out.get(name, 0.0) + sample.value
    return out


async def _replica_metrics(replica: Replica) -> dict[str, float] | None:
    if not replica.up:
        return None
    found = await fetch_exposition(replica)
    return None if found is None else engine_gauges(found[1])


def build_engine_router(
    pools: Sequence[Pool],
    supervisor: Supervisor,
    resolve: Callable[[Request], Awaitable[Principal]],
    *,
    before_auth: Callable[[Request], Awaitable[None]] | None = None,
) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"])

    @router.get("/engines")
    async def list_engines(request: Request) -> dict[str, Any]:
        if before_auth is not None:
            await before_auth(request)
        await resolve(request)
        processes = {str(p["name"]): p for p in supervisor.snapshot()}
        replicas = [(pool, r) for pool in pools for r in pool.replicas]
        metrics = await asyncio.gather(*(_replica_metrics(r) for _, r in replicas))
        data = []
        for (pool, replica), gauges in zip(replicas, metrics, strict=True):
            process = processes.get(replica.name, {})
            data.append(
                {
                    "object": "engine",
                    "name": replica.name,
                    "model": pool.name,
                    "state": process.get("state", "discovered"),
                    "pid": process.get("pid"),
                    "restarts": process.get("restarts", 0),
                    "up": replica.up,
                    "ejected": replica.ejected,
                    "outstanding": replica.outstanding,
                    "metrics": gauges,
                }
            )
        return {"object": "list", "data": data}

    return router
