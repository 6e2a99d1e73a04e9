"""The admin REST API under ``/admin/v1``: tenants, keys, plans, quota overrides, usage,
model prices and the usage export.

Every route depends on :meth:`Authenticator.resolve_admin` (the admin key or an admin-role
JWT); data-plane keys get 403. Bodies are pydantic models with ``extra="forbid"`` and strict
types, so malformed JSON, wrong types and unknown fields are 400 in OpenAI's shape (the app
must install :func:`portico.http_errors.install_error_handlers`; a body over the app's limit is
413 from :class:`portico.http_errors.BodySizeLimitMiddleware`). A key secret appears in exactly
one response: the one that creates it (create or rotate).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Coroutine
from datetime import date, datetime, timedelta, timezone
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, Security
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from redis.exceptions import RedisError

from gateway.identity.audit import Actor, AuditLog, entry_json
from gateway.identity.auth import Authenticator
from gateway.identity.plans import whole_number
from gateway.identity.prices import ModelPrice, PriceBook
from gateway.identity.principal import Principal
from gateway.identity.records import KeyCreate, Tenant, TenantCreate, TenantPatch
from gateway.identity.tenants import TenantStore
from gateway.identity.usage_export import MEDIA_TYPES, ExportFormat, export_rows, render
from portico.errors import (
    ERROR_SCHEMA_DOC,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)

log = logging.getLogger(__name__)

TenantIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
KeyIdPath = Annotated[str, Path(pattern=r"^key-[0-9a-f]{16}$")]
ModelPath = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^|\s]+$")]


class KeyRotate(BaseModel):
    """Body of ``POST .../keys/{key_id}/rotate``: how long the old secret keeps working."""

    model_config = ConfigDict(extra="forbid", strict=True)

    grace_seconds: Annotated[int, BeforeValidator(whole_number), Field(ge=0, le=30 * 86400)] = 0


DATE_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
# documented here, checked by _usage_date (so the 400 names the bare parameter)
DATE_SCHEMA: dict[str, Any] = {"format": "date", "pattern": DATE_PATTERN}
FIRST_USAGE_DATE = date(1970, 1, 1)  # before any usage the gateway can have recorded


def _usage_date(value: str | None, param: str) -> date | None:
    """A ``YYYY-MM-DD`` query value as a date from 1970 on, else a 400 naming ``param`` as
    every error names a parameter (``start``: portico/http_errors.py)."""
    if value is None:
        return None
    try:
        if not re.fullmatch(DATE_PATTERN, value):
            raise ValueError(value)
        day = date.fromisoformat(value)
    except ValueError:
        raise InvalidRequestError(
            f"Invalid value for '{param}': {value!r} is not a calendar date (YYYY-MM-DD).",
            param=param,
        ) from None
    if day < FIRST_USAGE_DATE:
        raise InvalidRequestError(
            f"Invalid value for '{param}': dates before {FIRST_USAGE_DATE} are out of range.",
            param=param,
        )
    return day


_REASONS = {
    400: "bad input, naming the parameter",
    401: "no admin credential, or a wrong one",
    403: "a valid credential that is not an admin's",
    404: "no such tenant, key or price",
    409: "the resource already exists",
    413: "body too large",
    429: "too many admin requests from this address",
    503: "the gateway's store is unavailable",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, each with OpenAI's error shape."""
    return {
        s: {
            "description": _REASONS[s],
            "content": {"application/json": {"schema": ERROR_SCHEMA_DOC}},
        }
        for s in statuses
    }


def _tenant_view(store: TenantStore, tenant: Tenant) -> dict[str, Any]:
    """The tenant record plus what it adds up to (effective limits, models, salt policy, the
    scheduling share its engine requests carry)."""
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
                    "budget_usd",
                    "budget_period",
                )
            },
            "allowed_models": sorted(principal.allowed_models)
            if principal.allowed_models is not None
            else None,
            "shares_prefix_cache": (principal.cache_salt or "").startswith("shared:"),
            "engine_share": {
                "weight": principal.share.weight,
                "priority_class": principal.share.priority_class,
                "kv_share": principal.share.kv_share,
                "max_running": principal.share.max_running or None,
            },
        }
    return body


BeforeAuth = Callable[[Request], Awaitable[None]]
# Resolves the admin principal of a request (default: its Authorization header through
# Authenticator.resolve_admin; the console's sessions add the session cookie + CSRF token).
AdminResolver = Callable[[Request], Awaitable[Principal]]


class _AllowRoute(APIRoute):
    """A route whose 405 names every method of its path in ``Allow``, not only its own."""

    path_methods: frozenset[str] = frozenset()  # every method of this path, for Allow

    async def handle(self, scope: Any, receive: Any, send: Any) -> None:
        if self.methods and scope["method"] not in self.methods:
            allow = ", ".join(sorted(self.path_methods or self.methods))
            raise HTTPException(status_code=405, headers={"Allow": allow})
        await super().handle(scope, receive, send)


def _admin_route_class(
    authenticator: Authenticator, before_auth: BeforeAuth | None, resolve: AdminResolver | None
) -> type[_AllowRoute]:
    """The route class of the admin router: it authenticates before FastAPI reads the body, so
    an unauthenticated caller learns nothing from validation errors (401/403 always come
    first), and it turns a Redis failure into a 503."""

    class AdminRoute(_AllowRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def guarded(request: Request) -> Response:
                if before_auth is not None:
                    await before_auth(request)
                if resolve is not None:
                    admin = await resolve(request)
                else:
                    auth = request.headers.get("authorization")
                    admin = await authenticator.resolve_admin(auth)
                request.state.admin = admin
                request.state.actor = Actor.of_request(request, admin)
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
    invalidates the authenticator's cache and is recorded in the audit log (never with a
    secret)."""

    def __init__(
        self,
        store: TenantStore,
        authenticator: Authenticator,
        audit: AuditLog | None = None,
        prices: PriceBook | None = None,
    ) -> None:
        self.store = store
        self.authenticator = authenticator
        self.audit = audit if audit is not None else AuditLog(store.redis)
        self.prices = prices if prices is not None else PriceBook(store.redis)

    async def _changed(
        self,
        request: Request,
        action: str,
        target: str,
        tenant_id: str | None,
        before: Any = None,
        after: Any = None,
    ) -> None:
        self.authenticator.invalidate()
        actor: Actor = request.state.actor
        await self.audit.record(
            actor, action, target, tenant_id=tenant_id, before=before, after=after
        )

    async def list_plans(self) -> dict[str, Any]:
        store = self.store
        return {
            "object": "list",
            "default": store.default_plan,
            "data": [p.model_dump() for p in store.plans.values()],
        }

    async def create_tenant(self, spec: TenantCreate, request: Request) -> dict[str, Any]:
        tenant = await self.store.create_tenant(spec)
        await self._changed(
            request, "tenant.create", f"tenant:{tenant.id}", tenant.id, None, tenant.model_dump()
        )
        return _tenant_view(self.store, tenant)

    async def list_tenants(self) -> dict[str, Any]:
        tenants = await self.store.list_tenants()
        return {"object": "list", "data": [_tenant_view(self.store, t) for t in tenants]}

    async def get_tenant(self, tenant_id: TenantIdPath) -> dict[str, Any]:
        return _tenant_view(self.store, await self.store.require_tenant(tenant_id))

    async def update_tenant(
        self, tenant_id: TenantIdPath, patch: TenantPatch, request: Request
    ) -> dict[str, Any]:
        before = await self.store.require_tenant(tenant_id)
        tenant = await self.store.update_tenant(tenant_id, patch)
        await self._changed(
            request,
            "tenant.update",
            f"tenant:{tenant_id}",
            tenant_id,
            before.model_dump(),
            tenant.model_dump(),
        )
        return _tenant_view(self.store, tenant)

    async def delete_tenant(self, tenant_id: TenantIdPath, request: Request) -> Response:
        before = await self.store.require_tenant(tenant_id)
        await self.store.delete_tenant(tenant_id)
        await self._changed(
            request, "tenant.delete", f"tenant:{tenant_id}", tenant_id, before.model_dump()
        )
        return Response(status_code=204)

    async def create_key(
        self, tenant_id: TenantIdPath, spec: KeyCreate, request: Request
    ) -> dict[str, Any]:
        key, secret = await self.store.create_key(tenant_id, spec)
        await self._changed(request, "key.create", key.id, tenant_id, None, key.public())
        return {**key.public(), "key": secret}

    async def list_keys(self, tenant_id: TenantIdPath) -> dict[str, Any]:
        keys = await self.store.list_keys(tenant_id)
        return {"object": "list", "data": [k.public() for k in keys]}

    async def get_key(self, tenant_id: TenantIdPath, key_id: KeyIdPath) -> dict[str, Any]:
        return (await self.store.get_key(tenant_id, key_id)).public()

    async def revoke_key(
        self, tenant_id: TenantIdPath, key_id: KeyIdPath, request: Request
    ) -> dict[str, Any]:
        before = await self.store.get_key(tenant_id, key_id)
        key = await self.store.revoke_key(tenant_id, key_id)
        await self._changed(request, "key.revoke", key_id, tenant_id, before.public(), key.public())
        return key.public()

    async def rotate_key(
        self,
        tenant_id: TenantIdPath,
        key_id: KeyIdPath,
        request: Request,
        body: KeyRotate | None = None,
    ) -> dict[str, Any]:
        grace = body.grace_seconds if body is not None else 0
        before = await self.store.get_key(tenant_id, key_id)
        key, secret = await self.store.rotate_key(tenant_id, key_id, grace)
        old = await self.store.get_key(tenant_id, key_id)
        await self._changed(
            request,
            "key.rotate",
            key_id,
            tenant_id,
            before.public(),
            {"old_key": old.public(), "new_key": key.public(), "grace_seconds": grace},
        )
        return {**key.public(), "key": secret, "replaces": key_id}

    async def usage(
        self,
        tenant_id: TenantIdPath,
        start: Annotated[str | None, Query(json_schema_extra=DATE_SCHEMA)] = None,
        end: Annotated[str | None, Query(json_schema_extra=DATE_SCHEMA)] = None,
    ) -> dict[str, Any]:
        last = _usage_date(end, "end") or datetime.now(timezone.utc).date()
        first = _usage_date(start, "start") or max(FIRST_USAGE_DATE, last - timedelta(days=29))
        await self.store.require_tenant(tenant_id)
        return (await self.store.ledger.usage(tenant_id, first, last)).model_dump()

    async def usage_export(
        self,
        start: Annotated[str, Query(json_schema_extra=DATE_SCHEMA)],
        end: Annotated[str, Query(json_schema_extra=DATE_SCHEMA)],
        fmt: Annotated[ExportFormat, Query(alias="format")] = "csv",
        tenant_id: Annotated[str | None, Query(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")] = None,
    ) -> Response:
        """One row per tenant, key, model and UTC day in ``[start, end]`` (usage_export.py)."""
        first, last = _usage_date(start, "start"), _usage_date(end, "end")
        if first is None or last is None:  # both are required: FastAPI refused their absence
            raise InvalidRequestError("'start' and 'end' are required.", param="start")
        rows = await export_rows(self.store, first, last, tenant_id)
        name = f"usage-{first.isoformat()}-{last.isoformat()}.{fmt}"
        return PlainTextResponse(
            render(rows, fmt),
            media_type=MEDIA_TYPES[fmt],
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )

    async def list_prices(self) -> dict[str, Any]:
        """Every model's effective price (config, or an admin override), per 1M tokens."""
        await self.prices.refresh()
        return {"object": "list", "data": [e.public() for e in self.prices.entries()]}

    async def get_price(self, model: ModelPath) -> dict[str, Any]:
        await self.prices.refresh()
        entry = self.prices.entry(model)
        if entry is None:
            raise NotFoundError(f"No price is set for the model '{model}'.", param="model")
        return entry.public()

    async def put_price(
        self, model: ModelPath, price: ModelPrice, request: Request
    ) -> dict[str, Any]:
        """Set (override) a model's price; every replica charges it within its refresh."""
        before = self.prices.entry(model)
        entry = await self.prices.put(model, price)
        await self._changed(
            request,
            "price.set",
            f"price:{model}",
            None,
            before.public() if before is not None else None,
            entry.public(),
        )
        return entry.public()

    async def delete_price(self, model: ModelPath, request: Request) -> Response:
        """Drop the admin override: the config's price (or none) applies again."""
        before = self.prices.entry(model)
        if not await self.prices.delete(model):
            raise NotFoundError(f"No admin price is set for the model '{model}'.", param="model")
        await self._changed(
            request, "price.delete", f"price:{model}", None, before.public() if before else None
        )
        return Response(status_code=204)

    async def audit_log(
        self,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        before: Annotated[str | None, Query(pattern=r"^[0-9]{1,19}-[0-9]{1,19}$")] = None,
        actor: Annotated[str | None, Query(max_length=256)] = None,
        action: Annotated[str | None, Query(max_length=64)] = None,
        tenant_id: Annotated[str | None, Query(max_length=63)] = None,
        since: Annotated[float | None, Query(ge=0, le=1e11, description="unix seconds")] = None,
        until: Annotated[float | None, Query(ge=0, le=1e11, description="unix seconds")] = None,
    ) -> dict[str, Any]:
        """Audit entries, newest first; ``next`` is the ``before`` of the next page."""
        entries, cursor = await self.audit.read(
            limit=limit,
            before=before,
            actor=actor,
            action=action,
            tenant_id=tenant_id,
            since=since,
            until=until,
        )
        return {"object": "list", "data": [entry_json(e) for e in entries], "next": cursor}


OPENAPI_PATH = "/admin/v1/openapi.json"


def build_admin_router(
    store: TenantStore,
    authenticator: Authenticator,
    *,
    before_auth: BeforeAuth | None = None,
    audit: AuditLog | None = None,
    resolve: AdminResolver | None = None,
    prices: PriceBook | None = None,
) -> APIRouter:
    """The ``/admin/v1`` router. Writes invalidate the authenticator's cache at once and are
    appended to ``audit`` (default: an :class:`AuditLog` with default retention on the
    store's Redis).

    ``before_auth`` (e.g. the per-address admin rate limit) runs before the credential is
    checked, so failed guesses count too; router-level ``dependencies`` would run only after
    a successful authentication. ``resolve`` replaces the bearer-only credential check (the
    console's sessions: gateway/console/sessions.py). ``prices``: the gateway's price book, so
    a price set here is charged by this replica at once (default: one on the store's Redis).
    """
    api = AdminAPI(store, authenticator, audit, prices)
    route_class = _admin_route_class(authenticator, before_auth, resolve)
    # HTTPBearer only documents the scheme in OpenAPI; AdminRoute does the checking.
    router = APIRouter(
        prefix="/admin/v1",
        tags=["admin"],
        route_class=route_class,
        dependencies=[Security(HTTPBearer(auto_error=False))],
        responses=_errors(400, 401, 403, 413, 429, 503),
    )
    _add_api_routes(router, api)
    _add_openapi_and_allowed_methods(router, route_class)
    return router


def _add_api_routes(router: APIRouter, api: AdminAPI) -> None:
    """Plans, tenants, keys, usage and its export, prices, the audit log."""
    missing, conflict = _errors(404), _errors(409)
    tenant, key = "/tenants/{tenant_id}", "/tenants/{tenant_id}/keys/{key_id}"
    router.add_api_route("/plans", api.list_plans, methods=["GET"])
    router.add_api_route(
        "/tenants", api.create_tenant, methods=["POST"], status_code=201, responses=conflict
    )
    router.add_api_route("/tenants", api.list_tenants, methods=["GET"])
    router.add_api_route(tenant, api.get_tenant, methods=["GET"], responses=missing)
    router.add_api_route(tenant, api.update_tenant, methods=["PATCH"], responses=missing)
    router.add_api_route(
        tenant, api.delete_tenant, methods=["DELETE"], status_code=204, responses=missing
    )
    router.add_api_route(
        f"{tenant}/keys", api.create_key, methods=["POST"], status_code=201, responses=missing
    )
    router.add_api_route(f"{tenant}/keys", api.list_keys, methods=["GET"], responses=missing)
    router.add_api_route(key, api.get_key, methods=["GET"], responses=missing)
    router.add_api_route(f"{key}/revoke", api.revoke_key, methods=["POST"], responses=missing)
    router.add_api_route(
        f"{key}/rotate", api.rotate_key, methods=["POST"], status_code=201, responses=missing
    )
    router.add_api_route(f"{tenant}/usage", api.usage, methods=["GET"], responses=missing)
    export_body = {"schema": {"type": "string"}}
    router.add_api_route(
        "/usage/export",
        api.usage_export,
        methods=["GET"],
        response_class=PlainTextResponse,
        responses={
            **missing,
            200: {
                "description": "one row per tenant, key, model and UTC day",
                "content": {media: export_body for media in MEDIA_TYPES.values()},
            },
        },
    )
    router.add_api_route("/prices", api.list_prices, methods=["GET"])
    price = "/prices/{model:path}"  # remote model names may hold a slash
    router.add_api_route(price, api.get_price, methods=["GET"], responses=missing)
    router.add_api_route(price, api.put_price, methods=["PUT"], responses=missing)
    router.add_api_route(
        price, api.delete_price, methods=["DELETE"], status_code=204, responses=missing
    )
    router.add_api_route("/audit", api.audit_log, methods=["GET"])


def _add_openapi_and_allowed_methods(router: APIRouter, route_class: type[_AllowRoute]) -> None:
    """``/admin/v1/openapi.json``, and each route told every method its path has (for 405s)."""

    async def openapi() -> dict[str, Any]:
        """This API's own OpenAPI document (also part of the gateway's /openapi.json): the
        contract tests/hardening holds it to."""
        routes = [r for r in router.routes if getattr(r, "path", "") != OPENAPI_PATH]
        document = get_openapi(title="Portico admin API", version="1", routes=routes)
        # Validation errors are 400 in OpenAI's shape (install_error_handlers), never the 422
        # FastAPI documents by default.
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            document.get("components", {}).get("schemas", {}).pop(name, None)
        return document

    router.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    # A 405 names every method the path has, not only those of the route that matched first.
    methods_by_path: dict[str, set[str]] = {}
    for route in router.routes:
        if isinstance(route, route_class):
            methods_by_path.setdefault(route.path, set()).update(route.methods or ())
    for route in router.routes:
        if isinstance(route, route_class):
            route.path_methods = frozenset(methods_by_path[route.path])
