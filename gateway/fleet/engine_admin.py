"""``GET /admin/v1/engines``: the state of every local engine replica, as JSON.

What the supervisor knows (state, pid, restarts), what the pool knows (up, ejected, requests
outstanding from this gateway) and what the replica's own ``/metrics`` says now (requests
running and waiting, KV cache usage, preemptions), the same scrape ``/metrics/engines`` does.
A replica whose metrics do not answer shows ``metrics: null``. ``tenants`` lists what the
replica's scheduler reports per tenant (the ``portico_engine_tenant_*`` families: tokens
scheduled since the engine started, requests running and waiting, KV blocks held now, the
running slots the fair policy owes the tenant now), busiest
first; ``null`` with the metrics. Admin credential only, checked like the rest of the admin API.
The console's engines page reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from gateway.fleet.engine_metrics import fetch_exposition
from gateway.fleet.pool import Pool, Replica
from gateway.fleet.supervisor import Supervisor
from gateway.identity.principal import Principal

# engine metric name -> field of the answer (vLLM's names, engine/server/metrics.py)
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:num_preemptions": "preemptions",
}


# engine per-tenant family -> field of a tenant's row (engine/server/metrics.py); the token
# counter is split by its ``kind`` label into prompt_tokens / generation_tokens
TENANT_FAMILIES = {
    "portico_engine_tenant_requests_running": "running",
    "portico_engine_tenant_requests_waiting": "waiting",
    "portico_engine_tenant_kv_blocks": "kv_blocks",
    "portico_engine_tenant_slot_share": "slot_share",
}
TENANT_TOKENS = "portico_engine_tenant_tokens"
TENANT_FIELDS = (
    "prompt_tokens",
    "generation_tokens",
    "running",
    "waiting",
    "kv_blocks",
    "slot_share",
)


def engine_gauges(families: Sequence[Metric]) -> dict[str, float]:
    """The :data:`GAUGES` of one exposition, summed over label sets (one per served model)."""
    out: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            name = GAUGES.get(sample.name) or GAUGES.get(family.name)
            if name is not None and sample.name in (family.name, f"{family.name}_total"):
                out[name] = out.get(name, 0.0) + sample.value
    return out


def tenant_rows(families: Sequence[Metric]) -> list[dict[str, Any]]:
    """One row per tenant of one exposition (:data:`TENANT_FIELDS`, summed over the other
    labels), tenants holding the most KV blocks, then with the most tokens, first."""
    rows: dict[str, dict[str, Any]] = {}
    for family in families:
        field = TENANT_FAMILIES.get(family.name)
        if field is None and family.name.removesuffix("_total") != TENANT_TOKENS:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or "tenant" not in sample.labels:
                continue
            if field is None:  # the token counter: one field per kind
                field_name = f"{sample.labels.get('kind', 'generation')}_tokens"
                if field_name not in TENANT_FIELDS:
                    continue
            else:
                field_name = field
            tenant = sample.labels["tenant"]
            row = rows.setdefault(tenant, {"tenant": tenant} | dict.fromkeys(TENANT_FIELDS, 0))
            row[field_name] += int(sample.value)
    return sorted(
        rows.values(),
        key=lambda r: (
            -r["kv_blocks"],
            -(r["prompt_tokens"] + r["generation_tokens"]),
            r["tenant"],
        ),
    )


async def _replica_metrics(
    replica: Replica,
) -> tuple[dict[str, float], list[dict[str, Any]]] | None:
    if not replica.up:
        return None
    found = await fetch_exposition(replica)
    if found is None:
        return None
    families = list(text_string_to_metric_families(found[1]))  # parsed once for both
    return engine_gauges(families), tenant_rows(families)


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
        for (pool, replica), scraped in zip(replicas, metrics, strict=True):
            process = processes.get(replica.name, {})
            gauges, tenants = scraped if scraped is not None else (None, None)
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
                    "tenants": tenants,
                }
            )
        return {"object": "list", "data": data}

    return router
