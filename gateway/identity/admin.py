"""The admin REST API under ``/admin/v1``: tenants, keys, plans, quota overrides, usage.

Every route depends on :meth:`Authenticator.resolve_admin` (the admin key or an admin-role
JWT); data-plane keys get 403. Bodies are pydantic models with ``extra="forbid"`` and strict
types, so malformed JSON, wrong types and unknown fields are 400 in OpenAI's shape (the app
must install :func:`portico.http_errors.install_error_handlers`; a body over the app's limit is
413 from :class:`portico.http_errors.BodySizeLimitMiddleware`). A key secret appears in exactly
one response: the one that creates it (create or rotate).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import date, datetime, timedelta, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response, Security
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError

from gateway.identity.auth import Authenticator
from gateway.identity.records import KeyCreate, Tenant, TenantCreate, TenantPatch
from gateway.identity.tenants import TenantStore
from portico.errors import ServiceUnavailableError

log = logging.getLogger(__name__)

TenantIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
KeyIdPath = Annotated[str, Path(pattern=r"^key-[0-9a-f]{16}$")]


class KeyRotate(BaseModel):
    """Body of ``POST .../keys/{key_id}/rotate``: how long the old secret keeps working."""

    model_config = ConfigDict(extra="forbid", strict=True)

    grace_seconds: Annotated[int, Field(ge=0, le=30 * 86400)] = 0


def _tenant_view(store: TenantStore, tenant: Tenant) -> dict[str, Any]:
    """The tenant record plus what it adds up to (effective limits, models, salt policy)."""
    body = tenant.model_dump()
    plan = store.plans.get(tenant.plan)
    if plan is not None:
        principal = store.principal_for(tenant)
        body["effective"] = {
            "limits": {
                k: getattr(principal.limits, k)
                for k in (
                    "requests_per_minute",
                    "tokens_per_minute",
                    "max_concurrency",
                    "monthly_token_budget",
                    "max_tokens_default",
                )
            },
            "allowed_models": sorted(principal.allowed_models)
            if principal.allowed_models is not None
            else None,
            "shares_prefix_cache": (principal.cache_salt or "").startswith("shared:"),
        }
    return body


BeforeAuth = Callable[[Request], Awaitable[None]]


def _admin_route_class(
    authenticator: Authenticator, before_auth: BeforeAuth | None
) -> type[APIRoute]:
    """The route class of the admin router: it authenticates before FastAPI reads the body, so
    an unauthenticated caller learns nothing from validation errors (401/403 always come
    first), and it turns a Redis failure into a 503."""

    class AdminRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                if before_auth is not None:
                    await before_auth(request)
                auth = request.headers.get("authorization")
                request.state.admin = await authenticator.resolve_admin(auth)
                # Read (and cache) the body here, outside FastAPI's body parsing, which turns
                # any exception — BodySizeLimitMiddleware's 413 signal included — into a 400.
                await request.body()
                try:
                    return await handler(request)
                except RedisError as exc:
                    log.warning("admin: Redis unavailable (%s)", type(exc).__name__)
                    raise ServiceUnavailableError(
                        "The gateway's store is unavailable; retry shortly.",
                        headers={"retry-after": "1"},
                    ) from None

            return guarded

    return AdminRoute


class AdminAPI:
    """The admin routes' handlers, one method per route, over one store. Every write
    invalidates the authenticator's cache and is logged (never with a secret)."""

    def __init__(self, store: TenantStore, authenticator: Authenticator) -> None:
        self.store = store
        self.authenticator = authenticator

    def _changed(self, action: str, **fields: str) -> None:
        self.authenticator.invalidate()
        log.info("admin: %s %s", action, " ".join(f"{k}={v}" for k, v in fields.items()))

    async def list_plans(self) -> dict[str, Any]:
        store = self.store
        return {
            "object": "list",
            "default": store.default_plan,
            "data": [p.model_dump() for p in store.plans.values()],
        }

    async def create_tenant(self, spec: TenantCreate) -> dict[str, Any]:
        tenant = await self.store.create_tenant(spec)
        self._changed("create tenant", tenant=tenant.id)
        return _tenant_view(self.store, tenant)

    async def list_tenants(self) -> dict[str, Any]:
        tenants = await self.store.list_tenants()
        return {"object": "list", "data": [_tenant_view(self.store, t) for t in tenants]}

    async def get_tenant(self, tenant_id: TenantIdPath) -> dict[str, Any]:
        return _tenant_view(self.store, await self.store.require_tenant(tenant_id))

    async def update_tenant(self, tenant_id: TenantIdPath, patch: TenantPatch) -> dict[str, Any]:
        tenant = await self.store.update_tenant(tenant_id, patch)
        fields = ",".join(sorted(patch.model_fields_set))
        self._changed("update tenant", tenant=tenant_id, fields=fields)
        return _tenant_view(self.store, tenant)

    async def delete_tenant(self, tenant_id: TenantIdPath) -> Response:
        await self.store.delete_tenant(tenant_id)
        self._changed("delete tenant", tenant=tenant_id)
        return Response(status_code=204)

    async def create_key(self, tenant_id: TenantIdPath, spec: KeyCreate) -> dict[str, Any]:
        key, secret = await self.store.create_key(tenant_id, spec)
        self._changed("create key", tenant=tenant_id, key=key.id)
        return {**key.public(), "key": secret}

    async def list_keys(self, tenant_id: TenantIdPath) -> dict[str, Any]:
        keys = await self.store.list_keys(tenant_id)
        return {"object": "list", "data": [k.public() for k in keys]}

    async def get_key(self, tenant_id: TenantIdPath, key_id: KeyIdPath) -> dict[str, Any]:
        return (await self.store.get_key(tenant_id, key_id)).public()

    async def revoke_key(self, tenant_id: TenantIdPath, key_id: KeyIdPath) -> dict[str, Any]:
        key = await self.store.revoke_key(tenant_id, key_id)
        self._changed("revoke key", tenant=tenant_id, key=key_id)
        return key.public()

    async def rotate_key(
        self, tenant_id: TenantIdPath, key_id: KeyIdPath, body: KeyRotate | None = None
    ) -> dict[str, Any]:
        grace = body.grace_seconds if body is not None else 0
        key, secret = await self.store.rotate_key(tenant_id, key_id, grace)
        self._changed("rotate key", tenant=tenant_id, key=key_id, new_key=key.id)
        return {**key.public(), "key": secret, "replaces": key_id}

    async def usage(
        self,
        tenant_id: TenantIdPath,
        start: Annotated[date | None, Query()] = None,
        end: Annotated[date | None, Query()] = None,
    ) -> dict[str, Any]:
        await self.store.require_tenant(tenant_id)
        today = datetime.now(timezone.utc).date()
        end = end or today
        start = start or end - timedelta(days=29)
        return (await self.store.ledger.usage(tenant_id, start, end)).model_dump()


OPENAPI_PATH = "/admin/v1/openapi.json"


def build_admin_router(
    store: TenantStore,
    authenticator: Authenticator,
    *,
    before_auth: BeforeAuth | None = None,
) -> APIRouter:
    """The ``/admin/v1`` router. Writes invalidate the authenticator's cache at once.

    ``before_auth`` (e.g. the per-address admin rate limit) runs before the credential is
    checked, so failed guesses count too; router-level ``dependencies`` would run only after
    a successful authentication.
    """
    api = AdminAPI(store, authenticator)
    # HTTPBearer only documents the scheme in OpenAPI; AdminRoute does the checking.
    router = APIRouter(
        prefix="/admin/v1",
        tags=["admin"],
        route_class=_admin_route_class(authenticator, before_auth),
        dependencies=[Security(HTTPBearer(auto_error=False))],
    )
    tenant, key = "/tenants/{tenant_id}", "/tenants/{tenant_id}/keys/{key_id}"
    router.add_api_route("/plans", api.list_plans, methods=["GET"])
    router.add_api_route("/tenants", api.create_tenant, methods=["POST"], status_code=201)
    router.add_api_route("/tenants", api.list_tenants, methods=["GET"])
    router.add_api_route(tenant, api.get_tenant, methods=["GET"])
    router.add_api_route(tenant, api.update_tenant, methods=["PATCH"])
    router.add_api_route(tenant, api.delete_tenant, methods=["DELETE"], status_code=204)
    router.add_api_route(f"{tenant}/keys", api.create_key, methods=["POST"], status_code=201)
    router.add_api_route(f"{tenant}/keys", api.list_keys, methods=["GET"])
    router.add_api_route(key, api.get_key, methods=["GET"])
    router.add_api_route(f"{key}/revoke", api.revoke_key, methods=["POST"])
    router.add_api_route(f"{key}/rotate", api.rotate_key, methods=["POST"], status_code=201)
    router.add_api_route(f"{tenant}/usage", api.usage, methods=["GET"])

    async def openapi() -> dict[str, Any]:
        """This API's own OpenAPI document (also part of the gateway's /openapi.json)."""
        routes = [r for r in router.routes if getattr(r, "path", "") != OPENAPI_PATH]
        return get_openapi(title="Portico admin API", version="1", routes=routes)

    router.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    return router
