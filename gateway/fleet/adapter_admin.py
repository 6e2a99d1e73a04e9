"""``/admin/v1/adapters``: register a LoRA adapter (shared, or private to one tenant), list
them, remove one. Admin credential only, checked before the body is read, like the rest of
the admin API; registering loads the adapter into the engines of its base model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from gateway.fleet.adapters import Adapter, AdapterCatalog
from gateway.identity.audit import Actor, AuditLog
from gateway.identity.auth import Authenticator
from gateway.identity.principal import Principal
from gateway.identity.tenants import TenantStore
from portico.errors import InvalidRequestError


class AdapterCreate(BaseModel):
    """The body of ``POST /admin/v1/adapters``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][\w.:/-]*$")
    base_model: str = Field(min_length=1)
    path: str = Field(min_length=1, description="the PEFT adapter folder, on the server")
    tenant_id: str | None = Field(default=None, description="owner; null: shared")


def build_adapter_router(
    catalog: AdapterCatalog,
    store: TenantStore,
    authenticator: Authenticator,
    *,
    before_auth: Callable[[Request], Awaitable[None]] | None = None,
    audit: AuditLog | None = None,
    resolve: Callable[[Request], Awaitable[Principal]] | None = None,
) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"])
    audit_log = audit if audit is not None else AuditLog(store.redis)

    async def admin(request: Request) -> Actor:
        if before_auth is not None:
            await before_auth(request)
        if resolve is not None:  # the console's session check (gateway/console/sessions.py)
            principal = await resolve(request)
        else:
            principal = await authenticator.resolve_admin(request.headers.get("authorization"))
        return Actor.of_request(request, principal)

    @router.post("/adapters", status_code=201)
    async def create_adapter(request: Request) -> dict[str, Any]:
        actor = await admin(request)
        try:
            spec = AdapterCreate.model_validate_json(await request.body())
        except ValueError as exc:
            raise InvalidRequestError(f"Invalid adapter: {exc}", param="body") from None
        if spec.tenant_id is not None and await store.get_tenant(spec.tenant_id) is None:
            raise InvalidRequestError(
                f"No tenant '{spec.tenant_id}'.", param="tenant_id", code="tenant_not_found"
            )
        adapter = await catalog.register(Adapter(**spec.model_dump()))
        await audit_log.record(
            actor, "adapter.create", f"adapter:{adapter.name}", tenant_id=adapter.tenant_id,
            after=asdict(adapter),
        )  # fmt: skip
        return {"object": "adapter", **asdict(adapter)}

    @router.get("/adapters")
    async def list_adapters(request: Request) -> dict[str, Any]:
        await admin(request)
        data = [
            {"object": "adapter", **asdict(a), "loaded_on": sorted(catalog.loaded_on.get(n, ()))}
            for n, a in sorted(catalog.adapters.items())
        ]
        return {"object": "list", "data": data}

    @router.delete("/adapters/{name:path}")
    async def delete_adapter(name: str, request: Request) -> dict[str, Any]:
        actor = await admin(request)
        adapter = await catalog.remove(name)
        await audit_log.record(
            actor, "adapter.delete", f"adapter:{adapter.name}", tenant_id=adapter.tenant_id,
            before=asdict(adapter),
        )  # fmt: skip
        return {"object": "adapter", "name": adapter.name, "deleted": True}

    return router
