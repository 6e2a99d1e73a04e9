"""The :class:`Gateway`: what one gateway process holds while it serves, and the path of one
request through it, top to bottom as in ARCHITECTURE.md: request id -> authenticate -> parse ->
authorize + route -> admit -> forward (retries; then the route's fallback tiers, all before the
first byte) -> relay -> settle + release -> record usage.

:func:`gateway.lifecycle.start_gateway` builds it whole; :mod:`gateway.app` puts it behind the
routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from redis.exceptions import RedisError
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response

from gateway.admission.abuse import AbuseGuard
from gateway.admission.admission import (
    Admission,
    InsufficientQuotaError,
    LimitExceededError,
    Ticket,
)
from gateway.admission.prompt_tokens import PromptCounter
from gateway.admission.usage_recorder import UsageRecorder
from gateway.batch.batch_runner import BatchRunner
from gateway.batch.batches import BatchStore
from gateway.batch.files import FileStore
from gateway.body.fields import (
    GENERATING_KINDS,
    POOLING_KINDS,
    RequestFields,
    match_shared_prefix,
    parse_fields,
)
from gateway.body.image_parts import inline_image_urls, num_images
from gateway.config import GatewayConfig
from gateway.fleet.adapters import Adapter, AdapterCatalog
from gateway.fleet.pool import Pool, Replica
from gateway.fleet.supervisor import Supervisor
from gateway.identity.audit import AuditLog
from gateway.identity.auth import Identity
from gateway.identity.cache_salts import shared_prefix_salt
from gateway.identity.prices import PriceBook
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from gateway.relay.budget_stop import watch_budget
from gateway.relay.long_prompts import HEADER as TRUNCATED_HEADER
from gateway.relay.long_prompts import PromptFit
from gateway.relay.proxy import Exchange, LocalUpstream, RelayResponse, Upstream
from gateway.relay.request_context import CTX_KEY, InFlight, RequestContext, read_body
from gateway.relay.responses_store import ResponseChain, ResponseStore, input_items_page
from gateway.relay.routing import RouteDecision, Router, model_card
from gateway.store import SharedRedis
from gateway.tracing import NO_TRACE, GatewayTracing, NoTrace
from portico.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
    UpstreamError,
)
from portico.media_fetch import MediaFetcher

log = logging.getLogger("portico.gateway")

FAILED_AUTH_MEMORY_S = 300.0
# An upstream answer that refused the request's input: nothing ran, so admission gives back
# all it reserved (the request and its tokens), as if the gateway had refused it itself.
REFUSED_INPUT_STATUSES = frozenset({400, 404, 413, 422})
MAX_FAILED_AUTH_ADDRESSES = 10_000


def _check_images(principal: Principal, model: str, fields: RequestFields) -> int:
    """The image count; a 403 naming ``messages`` when the plan forbids images on ``model``."""
    count = num_images(fields.messages)
    if count and not principal.may_send_images(model):
        raise PermissionDeniedError(
            f"Your plan does not allow images with the model '{model}'.",
            param="messages",
            code="images_not_allowed",
        )
    return count


def _mark_shared_prefix(fields: RequestFields, principal: Principal, kind: str) -> None:
    """Note on ``fields`` the plan's shared prefix the prompt starts with, if any: local
    engines cache it under the plan's salt."""
    if principal.shared_prefixes and kind in ("chat", "completion"):
        num_chars = match_shared_prefix(fields, principal.shared_prefixes)
        if num_chars:
            fields.shared_prefix = (shared_prefix_salt(principal.plan), num_chars)


def _response(
    exchange: Exchange, headers: dict[str, str], finish: Callable[[], Awaitable[None]]
) -> Response:
    """The client's response: a whole body, or the relayed stream; ``finish`` settles after."""
    if exchange.body is not None:
        return Response(
            exchange.body,
            exchange.status,
            headers,
            exchange.content_type,
            background=BackgroundTask(finish),
        )
    raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw_headers += [
        (b"content-type", exchange.content_type.encode("latin-1")),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]
    return RelayResponse(exchange, raw_headers, finish)


@dataclass(eq=False)
class Gateway:
    """Everything one gateway process holds while it serves, built whole by
    :func:`gateway.lifecycle.start_gateway`.

    Every part is there from the moment the object exists; :meth:`stop` releases them in the
    reverse order of their making (engines drain first; Redis closes last).
    """

    config: GatewayConfig
    metrics: GatewayMetrics
    in_flight: InFlight
    redis: SharedRedis
    identity: Identity
    admission: Admission
    guard: AbuseGuard
    router: Router
    counter: PromptCounter
    upstreams: Mapping[str, Upstream]  # model -> local engine pool or remote provider
    pools: list[Pool]  # local engine pools (readiness, /metrics/engines); remotes are not here
    supervisor: Supervisor
    adapters: AdapterCatalog  # LoRA adapters as tenant-scoped models (fleet/adapters.py)
    audit: AuditLog  # every admin change (identity/audit.py)
    usage: UsageRecorder
    prices: PriceBook  # per-model prices: spend and money budgets (identity/prices.py)
    responses: ResponseStore  # stored Responses API responses, per tenant
    files: FileStore  # the Files API, per tenant (batch/files.py)
    batches: BatchStore  # the Batch API's records and line results (batch/batches.py)
    fits: Mapping[str, PromptFit]  # local model -> context length and long-prompt policy
    runtime_dir: Path
    media: MediaFetcher  # fetches image URLs for local engines, before admission (config.media)
    _engine_tasks: list[asyncio.Task[None]]  # adapter loads into engines that became ready
    _resources: contextlib.AsyncExitStack
    draining: bool = False
    tracing: GatewayTracing | None = None  # None: off (OTEL_* unset), no span is ever made
    _failed_auth: dict[str, float] = field(default_factory=dict)  # address -> last failure
    # feeds batch lines to serve(); made by start_gateway right after the gateway (it calls
    # back into it), None only in between
    batch_runner: BatchRunner | None = None

    async def stop(self) -> None:
        """Stop the engines (they drain), then close clients, usage, admission, identity and
        Redis, and remove a runtime directory the gateway made."""
        await self._resources.aclose()

    # ------------------------------------------------------------------ readiness

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: not draining, every pool has a replica, and the store is up, or down under
        a policy that still serves (``local``/``open``; under ``closed`` nothing is admitted).
        ``redis`` in the detail is what the failover limiter's timed probe last found
        (admission.start_watch)."""
        pools = {p.name: sum(1 for r in p.replicas if r.available) for p in self.pools}
        redis_up = self.admission.redis_up  # the failover limiter's state, kept by its probe
        serves_without_redis = self.config.admission.redis_down_policy != "closed"
        ready = not self.draining and all(pools.values()) and (redis_up or serves_without_redis)
        detail: dict[str, Any] = {
            "status": "ready" if ready else "not_ready",
            "draining": self.draining,
            "healthy_replicas": pools,
            "redis": "up" if redis_up else "down",
            "redis_down_policy": self.config.admission.redis_down_policy,
        }
        detail["engines"] = self.supervisor.snapshot()
        return ready, detail

    def begin_drain(self) -> None:
        """Readiness turns false and new requests get 503; in-flight ones go on."""
        if not self.draining:
            self.draining = True
            log.warning("draining: %d request(s) in flight", self.in_flight.count)

    # ------------------------------------------------------------------ authentication

    async def authenticate(self, request: Request) -> Principal:
        """The one resolver (``Authenticator.resolve``) behind the per-address abuse guard."""
        header = request.headers.get("authorization")
        address = request.client.host if request.client else "unknown"
        if not header:
            await self.guard.hit_unauthenticated(address)
        elif (
            address in self._failed_auth  # the loop's time only for an address that failed
            and asyncio.get_running_loop().time() - self._failed_auth[address]
            < FAILED_AUTH_MEMORY_S
        ):
            # Only addresses that failed here recently pay the extra Redis round trip.
            await self.guard.check_failed_auth(address)
        try:
            return await self.identity.authenticator.resolve(header)
        except AuthenticationError:
            if header:
                await self.guard.record_failed_auth(address)
                if len(self._failed_auth) >= MAX_FAILED_AUTH_ADDRESSES:
                    self._failed_auth.clear()
                self._failed_auth[address] = asyncio.get_running_loop().time()
            raise

    # ------------------------------------------------------------------ the request path

    async def complete(self, request: Request, kind: str, path: str) -> Response:
        """The model-serving routes (hot_routes.HOT_PATHS), traced when tracing is on."""
        tracing = self.tracing
        if tracing is None:
            return await self._complete(request, kind, path, NO_TRACE)
        trace = tracing.start(request, kind, path, request.scope[CTX_KEY].request_id)
        try:
            return await self._complete(request, kind, path, trace)
        except BaseException as exc:
            trace.fail(exc)
            raise

    async def _complete(self, request: Request, kind: str, path: str, trace: NoTrace) -> Response:
        """The request path, top to bottom; ``trace`` gets its steps (NO_TRACE: nothing)."""
        ctx: RequestContext = request.scope[CTX_KEY]
        if self.draining:
            raise ServiceUnavailableError(
                "The gateway is shutting down; retry elsewhere.",
                code="draining",
                headers={"retry-after": "1"},
            )
        with trace.phase("authenticate"):
            principal = await self.authenticate(request)
        ctx.tenant = principal.tenant_id
        raw = await read_body(request)
        return await self.serve(principal, raw, kind, path, ctx, trace)

    async def serve(
        self,
        principal: Principal,
        raw: bytes,
        kind: str,
        path: str,
        ctx: RequestContext,
        trace: NoTrace = NO_TRACE,
    ) -> Response:
        """An authenticated request's path from parsing on: route, admit, forward, relay,
        settle. The routes come here through :meth:`complete`; the batch runner
        (batch/batch_runner.py) sends each batch line here with its owner's principal at
        the ``batch`` priority class, so a line is admitted, routed, charged and settled
        exactly as the same request sent interactively. Settling runs as the returned
        response's background task (a relayed stream's ``on_close``)."""
        ctx.tenant = principal.tenant_id
        routing_began = trace.mark()
        fields = parse_fields(raw, kind)
        _mark_shared_prefix(fields, principal, kind)
        chain = None
        if kind == "responses":  # previous_response_id: the stored turns join the input
            chain = ResponseChain(self.responses, principal.tenant_id, fields)
            await chain.prepare()
        adapter, decision, upstream, base, avoid = self._route(fields, principal, kind, path)
        ctx.model, ctx.tier = decision.model, decision.tier
        images = await self._images(principal, base, fields, upstream)
        prompt_tokens = self.counter.count(base, fields)
        fit = self.fits.get(base)
        truncated = None
        if fit is not None:  # over the context: the model's policy may cut the prompt
            prompt_tokens, truncated = fit.apply(fields, prompt_tokens, self.counter, base)
            if not fields.num_tools and self.counter.tokenizers.get(base) is not None:
                fit.check_room(fields, prompt_tokens)  # exact count: a 400 before admission
        trace.routed(routing_began, decision, fields, principal)
        with trace.phase("admit"):
            ticket, decision = await self._admit_or_fall_back(
                principal, decision, prompt_tokens, fields, ctx
            )
        try:
            send_max = ticket.max_tokens
            if send_max is not None and fit is not None:  # a cap past the context: none
                send_max = fit.cap_max_tokens(prompt_tokens, send_max)
            if send_max is not None:  # the client set none: send what was reserved
                fields.body[fields.max_tokens_field] = send_max
            with trace.current():  # upstream attempts are children of the request's span
                if adapter is not None or kind not in ("chat", "completion"):
                    # an adapter's engines, or a local-only endpoint: no tier to fall back to
                    exchange = await self._exchange_pinned(
                        upstream, raw, fields, kind, path, decision, principal, send_max, ctx, avoid
                    )
                else:
                    exchange, decision = await self.forward(
                        path, raw, fields, decision, principal, send_max, ctx
                    )
        except BaseException:
            await self.admission.release(ticket)
            raise
        ctx.upstream_s = exchange.upstream_s
        trace.answered(exchange)
        if ticket.budget_stop is not None and send_max is not None and exchange.status == 200:
            watch_budget(exchange, ticket.budget_stop, send_max)  # a stream it cut says so
        headers = {**ticket.headers, "x-portico-route": decision.header}
        served = decision.model
        if truncated is not None:
            headers[TRUNCATED_HEADER] = truncated

        async def finish() -> None:
            try:
                await self.settle(ticket, principal, served, exchange, prompt_tokens, images)
            finally:
                trace.end(exchange)

        if chain is not None and exchange.status == 200:
            await chain.follow(exchange)
        return _response(exchange, headers, finish)

    async def _images(
        self, principal: Principal, base: str, fields: RequestFields, upstream: Upstream
    ) -> int:
        """The image count (plan checked); a local engine's image URLs fetched (docs/vision.md)."""
        count = _check_images(principal, base, fields)
        if count and fields.kind == "chat" and isinstance(upstream, LocalUpstream):
            if await inline_image_urls(fields.messages or [], self.media):
                fields.edited = True
        return count

    async def _exchange_pinned(
        self,
        upstream: Upstream,
        raw: bytes,
        fields: RequestFields,
        kind: str,
        path: str,
        decision: RouteDecision,
        principal: Principal,
        send_max: int | None,
        ctx: RequestContext,
        avoid: tuple[Replica, ...],
    ) -> Exchange:
        """The exchange with the one upstream the request is pinned to (an adapter's
        engines, or a local-only endpoint's): no tier to fall back to."""
        salt = principal.cache_salt if kind in GENERATING_KINDS or kind in POOLING_KINDS else None
        payload = upstream.payload(raw, fields, decision.model, salt, send_max)
        return await upstream.exchange(
            path,
            payload,
            fields,
            ctx.request_id,
            decision.prefix_key,
            avoid,
            principal=principal,  # the engine hop names the tenant
        )

    def _route(
        self, fields: RequestFields, principal: Principal, kind: str, path: str
    ) -> tuple[Adapter | None, RouteDecision, Upstream, str, tuple[Replica, ...]]:
        """Where the request goes: (its adapter, the decision, the upstream, the base model
        whose tokenizer counts it, the replicas to avoid)."""
        adapter = self.adapters.resolve(fields.model, principal)
        avoid: tuple[Replica, ...] = ()
        if adapter is not None:  # a LoRA adapter: its base model's engines, its own limits
            decision = self._adapter_decision(adapter, fields, principal)
            upstream, base = self.upstreams[adapter.base_model], adapter.base_model
            avoid = self.adapters.lacking(adapter)
        else:  # another tenant's private adapter lands here too: the same 404 as no model
            decision = self.router.route(fields, principal)
            upstream, base = self.upstreams[decision.model], decision.model
        if kind not in ("chat", "completion") and not isinstance(upstream, LocalUpstream):
            raise InvalidRequestError(
                f"'{path}' is served by the local engines only; '{decision.model}' is a remote "
                "provider.",
                param="model",
                code="unsupported_endpoint",
            )
        return adapter, decision, upstream, base, avoid

    async def _admit_or_fall_back(
        self,
        principal: Principal,
        decision: RouteDecision,
        prompt_tokens: int,
        fields: RequestFields,
        ctx: RequestContext,
    ) -> tuple[Ticket, RouteDecision]:
        """Admit on the decision's model; a model out of quota here falls back to the next
        tier, if the decision has one."""
        while True:
            try:
                ticket = await self.admit(
                    principal,
                    decision.model,
                    prompt_tokens,
                    fields.max_tokens,
                    fields.num_outputs,
                    num_images(fields.messages),
                )
                return ticket, decision
            except LimitExceededError as exc:  # this tier's model is out of quota here
                if exc.scope != "model" or not decision.fallbacks:
                    raise
                decision = self._fall_back(decision, f"quota_{exc.limit}", ctx)

    async def forward(
        self,
        path: str,
        raw: bytes,
        fields: RequestFields,
        decision: RouteDecision,
        principal: Principal,
        max_tokens: int | None,
        ctx: RequestContext,
    ) -> tuple[Exchange, RouteDecision]:
        """Send to the decision's upstream; when its tier is down, out of quota or over its
        latency budget, to its fallback tiers in order. Only before the first byte: an
        :class:`Exchange` is returned with its first byte ready, and is never abandoned after.
        Returns the answer and the decision that produced it (for ``x-portico-route``); the
        time spent on tiers that failed counts as upstream time (``x-portico-overhead-ms``)."""
        spent = 0.0
        while True:
            upstream = self.upstreams[decision.model]
            credential = await self._credential(upstream, principal)
            payload = upstream.payload(
                raw, fields, decision.model, principal.cache_salt, max_tokens
            )
            prefix = decision.prefix_key
            args = (path, payload, fields, ctx.request_id, prefix, (), credential, principal)
            started = time.monotonic()
            try:
                if decision.fallbacks and decision.latency_budget_s is not None:
                    async with asyncio.timeout(decision.latency_budget_s):
                        exchange = await upstream.exchange(*args)
                else:
                    exchange = await upstream.exchange(*args)
            except TimeoutError:
                if not decision.fallbacks or decision.latency_budget_s is None:
                    raise  # not the budget's timeout
                why = "latency_budget"
            except (ServiceUnavailableError, UpstreamError) as exc:
                if not decision.fallbacks:
                    raise
                why = exc.code or "unavailable"
            else:
                if not decision.fallbacks or not _tier_failed(exchange.status):
                    exchange.upstream_s += spent
                    return exchange, decision
                why = f"status_{exchange.status}"
                if exchange.close is not None:
                    await exchange.close()
            spent += time.monotonic() - started
            decision = self._fall_back(decision, why, ctx)

    def _fall_back(self, decision: RouteDecision, why: str, ctx: RequestContext) -> RouteDecision:
        """The decision's next tier (it has one); logged and counted."""
        to = decision.fallbacks[0].name
        log.info("request %s: tier %s %s; trying %s", ctx.request_id, decision.tier, why, to)
        self.metrics.fallbacks.labels(decision.tier, to, why).inc()
        decision = decision.fall_back(why)
        ctx.model, ctx.tier = decision.model, decision.tier
        return decision

    async def _credential(self, upstream: Upstream, principal: Principal) -> str | None:
        """The tenant's own provider key for this upstream, if it takes one and has one."""
        keys = self.identity.provider_keys
        if not upstream.tenant_keys or keys is None:
            return None
        try:
            return await keys.get(principal.tenant_id, upstream.name)
        except RedisError:  # fail closed: never bill the operator's key for a tenant's
            raise ServiceUnavailableError(
                "Provider keys are temporarily unavailable; retry shortly.",
                code="provider_keys_unavailable",
                headers={"retry-after": "1"},
            ) from None

    def _adapter_decision(
        self, adapter: Adapter, fields: RequestFields, principal: Principal
    ) -> RouteDecision:
        if not adapter.allowed_for(principal):
            raise PermissionDeniedError(
                f"Your plan does not allow the model '{adapter.name}'.",
                param="model",
                code="model_not_allowed",
            )
        prefix = self.router.prefix_key(fields)
        return RouteDecision("direct", adapter.name, f"adapter:{adapter.base_model}", prefix)

    async def admit(
        self,
        principal: Principal,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        num_outputs: int = 1,
        num_images: int = 0,
    ) -> Ticket:
        try:
            return await self.admission.admit(
                principal, model, prompt_tokens, max_tokens, num_outputs, num_images
            )
        except LimitExceededError as exc:
            self.metrics.rate_limited.labels(exc.limit).inc()
            raise
        except InsufficientQuotaError:
            self.metrics.rate_limited.labels("monthly_token_budget").inc()
            raise

    async def settle(
        self,
        ticket: Ticket,
        principal: Principal,
        model: str,
        exchange: Exchange,
        prompt_tokens: int = 0,
        images: int = 0,
    ) -> None:
        """Settle with the real usage (or release the slot when there is none); record it;
        ``images``: the request's input images, each charged the model's image price.

        Usage the gateway counted itself (the upstream reported none) takes the prompt tokens
        admission counted, and the usage record says how the output was counted."""
        admission = self.admission
        recorder = self.usage
        usage = exchange.usage
        try:
            if usage.reported:  # usage is summed in memory and written in batches
                prompt = usage.prompt_tokens
                if usage.source != "upstream":
                    prompt = prompt_tokens
                    self.metrics.usage_counted.labels(model, usage.source).inc()
                cached = usage.cached_tokens if usage.source == "upstream" else 0
                completion = usage.completion_tokens
                # the served model's price: a fallback tier may differ from the one admitted
                spend = self.prices.spend_micro_usd(model, prompt, cached, completion, images)
                recorder.record(
                    principal.tenant_id,
                    model,
                    prompt,
                    completion,
                    usage.source,
                    key_id=principal.key_id,
                    cached_tokens=cached,
                    spend_micro_usd=spend,
                )
                if spend:
                    self.metrics.spend.labels(principal.tenant_id, model).inc(spend / 1e6)
                await admission.settle(ticket, prompt, completion, spend)
            elif exchange.status in REFUSED_INPUT_STATUSES:  # the engine's 400: costs nothing
                await admission.refund(ticket)
        except Exception as exc:  # accounting must never break a finished response
            log.warning("settling request usage failed: %s", exc)
        finally:
            await admission.release(ticket)

    async def stored_response(self, request: Request) -> JSONResponse:
        """``GET`` / ``DELETE /v1/responses/{id}``: the caller's tenant's stored responses."""
        principal = await self.authenticate(request)
        request.scope[CTX_KEY].tenant = principal.tenant_id
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            await self.responses.delete(principal.tenant_id, response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        stored = await self.responses.load(principal.tenant_id, response_id)
        if request.url.path.endswith("/input_items"):
            return JSONResponse(input_items_page(stored.input_items, request.query_params))
        return JSONResponse(stored.response)

    async def models(self, request: Request) -> JSONResponse:
        principal = await self.authenticate(request)
        request.scope[CTX_KEY].tenant = principal.tenant_id
        data = self.router.model_cards(principal)
        for a in self.adapters.visible(principal):
            owner = "portico" if a.tenant_id is None else a.tenant_id
            data.append(model_card(a.name, owner, parent=a.base_model))
        name = request.path_params.get("model")
        if name is None:
            return JSONResponse({"object": "list", "data": data})
        card = next((c for c in data if c["id"] == name), None)
        card = card or self.router.find_card(name, principal)
        if card is None:
            raise NotFoundError(f"The model '{name}' does not exist.", param="model")
        return JSONResponse(card)


def _tier_failed(status: int) -> bool:
    """An answer that sends the request on to a fallback tier: out of quota or down."""
    return status == 429 or status >= 500
