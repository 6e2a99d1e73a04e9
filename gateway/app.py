"""The gateway application: ``create_app(config)`` builds it, its lifespan starts and stops
everything it holds, and each route reads top to bottom as the request path of
ARCHITECTURE.md: request id -> authenticate -> parse -> authorize + route -> admit -> forward
(retries; then the route's fallback tiers, all before the first byte) -> relay -> settle +
release -> record usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
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
from gateway.admission.limiter import RedisLimiter
from gateway.admission.prompt_tokens import PromptCounter, load_tokenizer
from gateway.admission.redis_pipe import RedisPipe
from gateway.admission.usage_recorder import UsageRecorder
from gateway.config import PACKAGED_POLICIES, EngineSpec, GatewayConfig
from gateway.console.routes import build_console_router
from gateway.console.sessions import ConsoleSessions
from gateway.dataplane.adapter_admin import build_adapter_router
from gateway.dataplane.adapters import Adapter, AdapterCatalog
from gateway.dataplane.discovery import DNSDiscovery
from gateway.dataplane.engine_admin import build_engine_router
from gateway.dataplane.engine_metrics import scrape_engines
from gateway.dataplane.fields import GENERATING_KINDS, RequestFields, parse_fields
from gateway.dataplane.hot_routes import GatewayApp, HotRoutes
from gateway.dataplane.long_prompts import HEADER as TRUNCATED_HEADER
from gateway.dataplane.long_prompts import PromptFit, context_length
from gateway.dataplane.openai_remote import OpenAIRemoteUpstream
from gateway.dataplane.output_tokens import OutputCounter
from gateway.dataplane.pool import Pool, Replica
from gateway.dataplane.proxy import (
    Exchange,
    LocalUpstream,
    RelayResponse,
    Upstream,
    upstream_body,
)
from gateway.dataplane.remote import RemoteUpstream
from gateway.dataplane.request_context import (
    CTX_KEY,
    InFlight,
    RequestContext,
    RequestContextMiddleware,
)
from gateway.dataplane.responses_store import ResponseChain, ResponseStore, input_items_page
from gateway.dataplane.retry import RetryPolicy, load_retry_policy
from gateway.dataplane.routing import RouteDecision, Router, load_routing_policy
from gateway.dataplane.supervisor import EngineProcess, Supervisor, engine_argv
from gateway.dataplane.transport import LeanTransport
from gateway.identity.admin import build_admin_router
from gateway.identity.audit import AuditLog
from gateway.identity.auth import Identity, open_identity
from gateway.identity.layout import migrate_layout
from gateway.identity.principal import Principal
from gateway.identity.provider_keys import build_provider_key_router
from gateway.metrics import GatewayMetrics
from gateway.store import SharedRedis, open_shared_redis
from gateway.tls import AdminClientCertGuard
from gateway.tracing import NO_TRACE, GatewayTracing, NoTrace
from portico.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    ServiceUnavailableError,
    UpstreamError,
)
from portico.http_errors import BodySizeLimitMiddleware, install_error_handlers

log = logging.getLogger("portico.gateway")

FAILED_AUTH_MEMORY_S = 300.0
GC_YOUNG_THRESHOLD = 10_000
MAX_FAILED_AUTH_ADDRESSES = 10_000


@dataclass(eq=False)
class Gateway:
    """Everything one gateway process holds while it serves, built whole by :meth:`create`.

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
    adapters: AdapterCatalog  # LoRA adapters as tenant-scoped models (dataplane/adapters.py)
    audit: AuditLog  # every admin change (identity/audit.py)
    usage: UsageRecorder
    responses: ResponseStore  # stored Responses API responses, per tenant
    fits: Mapping[str, PromptFit]  # local model -> context length and long-prompt policy
    runtime_dir: Path
    _engine_tasks: list[asyncio.Task[None]]  # adapter loads into engines that became ready
    _resources: contextlib.AsyncExitStack
    draining: bool = False
    tracing: GatewayTracing | None = None  # None: off (OTEL_* unset), no span is ever made
    _failed_auth: dict[str, float] = field(default_factory=dict)  # address -> last failure

    @classmethod
    async def create(
        cls,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        in_flight: InFlight,
        env: Mapping[str, str],
    ) -> Gateway:
        """Open Redis once and hand it to identity, admission and usage; build the upstreams,
        the router and the supervisor; start the engines. On failure, what was opened closes."""
        fits = _prompt_fits(config)  # a bad long-prompt policy fails before anything starts
        async with contextlib.AsyncExitStack() as stack:
            runtime_dir = stack.enter_context(_runtime_dir(config.runtime_dir))
            tracing = GatewayTracing.from_env(env)
            if tracing is not None:  # closed last: the spans of the drain are exported too
                stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
            redis = await open_shared_redis(config.redis, env)
            stack.push_async_callback(redis.aclose)
            await migrate_layout(redis.client)  # keys named before hash tags, renamed once
            identity = open_identity(redis.client, config.redis, config.auth, env)
            stack.push_async_callback(identity.aclose)
            if config.admission.redis_down_policy != "closed":  # closed: an outage refuses all
                identity.authenticator.keep_outage_copy(config.auth.outage_copy_seconds)
            # Admission's two scripts per request go over one pipelined connection
            # (redis_pipe.py); redis-py's per-command cost was the largest single share of the
            # gateway's CPU.
            # None over TLS, on a cluster or through Sentinel: redis-py's client then
            pipe = RedisPipe.from_client(redis.client)
            if pipe is not None:
                stack.push_async_callback(pipe.aclose)
            limiter = RedisLimiter(
                redis.client, budget_ttl_s=config.admission.budget_key_ttl_seconds, pipe=pipe
            )
            admission = Admission(
                redis.client, config.admission, registry=metrics.registry, limiter=limiter
            )
            admission.start_watch()  # Redis probed on a timer; aclose stops the probe
            stack.push_async_callback(admission.aclose)
            usage = UsageRecorder(identity.store.ledger)
            usage.start()
            # closed after the engines drained: every request is counted
            stack.push_async_callback(usage.aclose)
            guard = AbuseGuard(redis.url, config.admission.abuse, registry=metrics.registry)
            retry = load_retry_policy(config.policies_dir / "retry.yaml")
            routing = load_routing_policy(config.policies_dir / "routing.yaml")
            local = _LocalEngines(config, runtime_dir, retry, routing.affinity_slack, metrics)
            for pool in local.pools:
                for replica in pool.replicas:
                    stack.push_async_callback(replica.client.aclose)
            upstreams: dict[str, Upstream] = dict(local.upstreams)
            for upstream in local.upstreams.values():
                upstream.tracer = tracing
            remote_tokenizers = await _load_remote_tokenizers(config)
            remote_pools: list[Pool] = []
            for spec in config.remotes:  # a missing credential stops the start-up here
                if spec.kind == "litellm":  # translation (Anthropic, Bedrock, ...)
                    upstreams[spec.name] = RemoteUpstream(spec, retry, metrics, env)
                    continue
                counter = OutputCounter(remote_tokenizers.get(spec.name))
                remote = OpenAIRemoteUpstream(spec, retry, metrics, env, counter=counter)
                stack.push_async_callback(remote.client.aclose)
                remote_pools.append(remote.pool)
                upstreams[spec.name] = remote
            router = Router(
                routing,
                set(upstreams),
                strict=config.policies_dir.resolve() != PACKAGED_POLICIES,
            )
            # The adapter catalog is read before the engines start: each engine that becomes
            # ready gets its pool's adapters (the supervisor's on_state).
            adapters = AdapterCatalog(
                redis.client,
                {p.name: p for p in local.pools},
                {*upstreams, *routing.aliases, "auto"},
            )
            await adapters.load()
            engine_tasks: list[asyncio.Task[None]] = []
            stack.push_async_callback(_cancel, engine_tasks)
            supervisor = _supervisor(local.processes, config, metrics, adapters, engine_tasks)
            for discovery in local.discoveries:  # closes the clients of what it found
                stack.push_async_callback(discovery.aclose)
            await asyncio.gather(*(d.refresh() for d in local.discoveries))
            probers = [
                asyncio.create_task(pool.run_prober()) for pool in [*local.pools, *remote_pools]
            ]
            probers += [asyncio.create_task(d.run()) for d in local.discoveries]
            stack.push_async_callback(_cancel, probers)
            stack.push_async_callback(supervisor.stop, config.supervisor.stop_timeout_s)
            timeout = max((e.startup_timeout_s for e in config.engines), default=0.0)
            tokenizers, all_ready = await asyncio.gather(
                _load_tokenizers(config), supervisor.start(ready_timeout=timeout)
            )
            if not all_ready:
                log.error("not every engine became ready in %.0f s; serving what is up", timeout)
            gateway = cls(
                config=config,
                metrics=metrics,
                in_flight=in_flight,
                redis=redis,
                identity=identity,
                admission=admission,
                guard=guard,
                router=router,
                counter=PromptCounter({**tokenizers, **remote_tokenizers}),
                upstreams=upstreams,
                pools=local.pools,
                supervisor=supervisor,
                adapters=adapters,
                audit=AuditLog(redis.client, config.audit),
                _engine_tasks=engine_tasks,
                usage=usage,
                responses=ResponseStore(redis.client, config.responses_retention_s),
                fits=fits,
                runtime_dir=runtime_dir,
                tracing=tracing,
                _resources=stack.pop_all(),
            )
        _freeze_startup_objects()
        return gateway

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
            asyncio.get_running_loop().time() - self._failed_auth.get(address, -1e18)
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
        raw = await request.body()
        routing_began = trace.mark()
        fields = parse_fields(raw, kind)
        chain = None
        if kind == "responses":  # previous_response_id: the stored turns join the input
            chain = ResponseChain(self.responses, principal.tenant_id, fields)
            await chain.prepare()
        adapter = self.adapters.resolve(fields.model, principal)
        avoid: tuple[Replica, ...] = ()
        if adapter is not None:  # a LoRA adapter: its base model's engines, its own limits
            decision = self._adapter_decision(adapter, fields, principal)
            upstream, base = self.upstreams[adapter.base_model], adapter.base_model
            avoid = self.adapters.lacking(adapter)
        else:  # another tenant's private adapter lands here too: the same 404 as no model
            decision = self.router.route(fields, principal)
            upstream, base = self.upstreams[decision.model], decision.model
        ctx.model, ctx.tier = decision.model, decision.tier
        if kind not in ("chat", "completion") and not isinstance(upstream, LocalUpstream):
            raise InvalidRequestError(
                f"'{path}' is served by the local engines only; '{decision.model}' is a remote "
                "provider.",
                param="model",
                code="unsupported_endpoint",
            )
        prompt_tokens = self.counter.count(base, fields)
        fit = self.fits.get(base)
        truncated = None
        if fit is not None:  # over the context: the model's policy may cut the prompt
            prompt_tokens, truncated = fit.apply(fields, prompt_tokens, self.counter, base)
        trace.routed(routing_began, decision, fields, principal)
        with trace.phase("admit"):
            while True:
                try:
                    ticket = await self.admit(
                        principal,
                        decision.model,
                        prompt_tokens,
                        fields.max_tokens,
                        fields.num_outputs,
                    )
                    break
                except LimitExceededError as exc:  # this tier's model is out of quota here
                    if exc.scope != "model" or not decision.fallbacks:
                        raise
                    decision = self._fall_back(decision, f"quota_{exc.limit}", ctx)
        try:
            send_max = ticket.max_tokens
            if send_max is not None and fit is not None:  # a cap past the context: none
                send_max = fit.cap_max_tokens(prompt_tokens, send_max)
            if send_max is not None:  # the client set none: send what was reserved
                fields.body[fields.max_tokens_field] = send_max
            with trace.current():  # upstream attempts are children of the request's span
                if adapter is not None or kind not in ("chat", "completion"):
                    # an adapter's engines, or a local-only endpoint: no tier to fall back to
                    salt = (
                        principal.cache_salt
                        if kind in GENERATING_KINDS or kind == "embedding"
                        else None
                    )
                    payload = upstream_body(raw, fields, decision.model, salt, send_max)
                    exchange: Exchange = await upstream.exchange(
                        path, payload, fields, ctx.request_id, decision.prefix_key, avoid
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
        headers = {**ticket.headers, "x-portico-route": decision.header}
        served = decision.model
        if truncated is not None:
            headers[TRUNCATED_HEADER] = truncated

        async def finish() -> None:
            try:
                await self.settle(ticket, principal, served, exchange, prompt_tokens)
            finally:
                trace.end(exchange)

        if chain is not None and exchange.status == 200:
            if exchange.body is not None:
                await chain.keep_body(exchange.body)
            elif exchange.rest is not None:
                await chain.keep_first(exchange.usage)
                exchange.rest = chain.keeping_stream(exchange.rest, exchange.usage)
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
            args = (path, payload, fields, ctx.request_id, decision.prefix_key, (), credential)
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
    ) -> Ticket:
        try:
            return await self.admission.admit(
                principal, model, prompt_tokens, max_tokens, num_outputs
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
    ) -> None:
        """Settle with the real usage (or release the slot when there is none); record it.

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
                recorder.record(
                    principal.tenant_id, model, prompt, usage.completion_tokens, usage.source
                )
                await admission.settle(ticket, prompt, usage.completion_tokens)
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
        names = self.router.visible_models(principal)
        data: list[dict[str, Any]] = [
            {"id": n, "object": "model", "created": 0, "owned_by": "portico"} for n in names
        ]
        for a in self.adapters.visible(principal):
            owner = "portico" if a.tenant_id is None else a.tenant_id
            data.append(
                {"id": a.name, "object": "model", "created": 0, "owned_by": owner,
                 "parent": a.base_model}
            )  # fmt: skip
        return JSONResponse({"object": "list", "data": data})


def _tier_failed(status: int) -> bool:
    """An answer that sends the request on to a fallback tier: out of quota or down."""
    return status == 429 or status >= 500


class _LocalEngines:
    """The local engine pools of the config: one pool per engine spec, one replica (process,
    Unix socket, HTTP client) per replica, and the upstream that forwards to each pool. A spec
    with ``discovery`` starts no process: its pool's replicas are the addresses DNS answers
    (``discoveries``), reached over TCP."""

    def __init__(
        self,
        config: GatewayConfig,
        runtime_dir: Path,
        retry: RetryPolicy,
        slack: int,
        metrics: GatewayMetrics,
    ) -> None:
        self.processes: list[EngineProcess] = []
        self.pools: list[Pool] = []
        self.upstreams: dict[str, LocalUpstream] = {}
        self.discoveries: list[DNSDiscovery] = []
        self._metrics = metrics
        timeout = httpx.Timeout(retry.read_timeout_s, connect=retry.connect_timeout_s)
        for spec in config.engines:
            replicas = [
                self._replica(spec, f"{spec.name}-{i}", runtime_dir, timeout)
                for i in range(spec.replicas if spec.discovery is None else 0)
            ]
            pool = Pool(
                spec.name,
                replicas,
                slack=slack,
                eject_after_failures=retry.eject_after_failures,
                eject_cooldown_s=retry.eject_cooldown_s,
                on_eject=self._count_ejection,
            )
            self.pools.append(pool)
            self.upstreams[spec.name] = LocalUpstream(pool, retry, metrics)
            if spec.discovery is not None:
                found = functools.partial(_tcp_replica, timeout=timeout)
                self.discoveries.append(DNSDiscovery(pool, spec.discovery, found))

    def _replica(
        self, spec: EngineSpec, name: str, runtime_dir: Path, timeout: httpx.Timeout
    ) -> Replica:
        uds = runtime_dir / f"{name}.sock"
        transport = LeanTransport(uds=str(uds))
        client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=timeout)
        replica = Replica(name, client, transport, timeout.as_dict())
        self.processes.append(
            EngineProcess(
                name,
                _engine_command(spec, name, uds),
                replica,
                socket_path=uds,
                env=dict(spec.env),
                startup_timeout_s=spec.startup_timeout_s,
            )
        )
        return replica

    def _count_ejection(self, replica: Replica) -> None:
        pool = replica.name.rsplit("-", 1)[0]
        self._metrics.ejections.labels(pool, replica.name).inc()


def _prompt_fits(config: GatewayConfig) -> dict[str, PromptFit]:
    """Each local model's context length and long-prompt policy (where the length is known;
    a truncating policy without one is a configuration error)."""
    fits = {}
    for spec in config.engines:
        length = context_length(spec.model, spec.args)
        if length is None:
            if spec.long_prompts != "refuse":
                raise ValueError(
                    f"engines[{spec.name}].long_prompts={spec.long_prompts} needs the context "
                    "length: add --max-model-len to its args"
                )
            continue
        fits[spec.name] = PromptFit(length, spec.long_prompts)
    return fits


def _tcp_replica(name: str, host: str, port: int, *, timeout: httpx.Timeout) -> Replica:
    """A replica of an engine found by DNS, with its own client to ``host:port``."""
    transport = LeanTransport(host=host, port=port)
    client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=timeout)
    return Replica(name, client, transport, timeout.as_dict())


def _engine_command(spec: EngineSpec, name: str, uds: Path) -> list[str]:
    if spec.command is None:
        return engine_argv(spec.model, spec.name, uds, list(spec.args))
    values = {"uds": str(uds), "model": spec.model, "name": spec.name, "replica": name}
    return [part.format(**values) for part in spec.command] + list(spec.args)


def _supervisor(
    processes: list[EngineProcess],
    config: GatewayConfig,
    metrics: GatewayMetrics,
    adapters: AdapterCatalog,
    tasks: list[asyncio.Task[None]],
) -> Supervisor:
    def on_state(process: EngineProcess) -> None:
        ready = process.state == "ready"
        metrics.engine_up.labels(process.name).set(1 if ready else 0)
        # a (re)started engine holds no adapter: it gets its pool's adapters again
        pool = process.name.rsplit("-", 1)[0]
        task = adapters.replica_changed(pool, process.replica, ready)
        if task is not None:
            tasks[:] = [t for t in tasks if not t.done()]
            tasks.append(task)

    return Supervisor(
        processes,
        backoff_base_s=config.supervisor.backoff_base_s,
        backoff_max_s=config.supervisor.backoff_max_s,
        stable_after_s=config.supervisor.stable_after_s,
        on_state=on_state,
        on_restart=lambda p: metrics.engine_restarts.labels(p.name).inc(),
    )


async def _load_remote_tokenizers(config: GatewayConfig) -> dict[str, Any]:
    """Tokenizers of remotes that name one (``remotes[].tokenizer``), by remote name."""
    wanted = [r for r in config.remotes if r.tokenizer is not None]
    loaded = await asyncio.gather(
        *(asyncio.to_thread(load_tokenizer, str(r.tokenizer)) for r in wanted)
    )
    return {r.name: tok for r, tok in zip(wanted, loaded, strict=True) if tok is not None}


async def _load_tokenizers(config: GatewayConfig) -> dict[str, Any]:
    wanted = [e for e in config.engines if e.count_tokens_with == "tokenizer" and e.command is None]
    loaded = await asyncio.gather(*(asyncio.to_thread(load_tokenizer, e.model) for e in wanted))
    return {e.name: tok for e, tok in zip(wanted, loaded, strict=True) if tok is not None}


@contextlib.contextmanager
def _runtime_dir(configured: Path | None) -> Iterator[Path]:
    """Where the engines' sockets go: the configured directory, else a private temporary one
    (removed at the end)."""
    if configured is not None:
        configured.mkdir(parents=True, exist_ok=True)
        yield configured
        return
    own = tempfile.TemporaryDirectory(prefix="portico-")
    try:
        yield Path(own.name)
    finally:
        with contextlib.suppress(OSError):
            own.cleanup()


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _freeze_startup_objects() -> None:
    # Everything loaded so far lives as long as the process: keep the cyclic collector from
    # rescanning it (tokenizers, litellm, pydantic models) on every full collection.
    gc.collect()
    gc.freeze()
    # A request leaves almost no cyclic garbage, but with requests in flight every young
    # collection finds live objects and promotes them, and every tenth one scans the older
    # generations (6 ms each at saturation, freeing nothing). Collecting the young
    # generation every 10k net allocations instead of 700 cut the collector's share of the
    # gateway's CPU from about 8 % to under 2 % at saturation; one such pass takes ~1 ms.
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, gen1, gen2)


def create_app(config: GatewayConfig, *, env: Mapping[str, str] | None = None) -> FastAPI:
    """The gateway as an ASGI app; its lifespan builds the :class:`Gateway` and stops it.

    ``app.state.gateway`` is the :class:`Gateway` once the lifespan has started (the server's
    drain logic and every route read it there).
    """
    metrics = GatewayMetrics()
    in_flight = InFlight()

    @contextlib.asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        gateway = await Gateway.create(
            config, metrics, in_flight, env if env is not None else os.environ
        )
        try:
            _serve_gateway(app, gateway)
            yield
        finally:
            await gateway.stop()

    # FastAPI's native OpenTelemetry checks its providers on every request; the gateway
    # exports its own Prometheus metrics, so that check is turned off.
    app = GatewayApp(
        title="Portico gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.tls is not None and config.tls.admin_requires_client_cert:
        app.add_middleware(AdminClientCertGuard)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, in_flight=in_flight)
    # POST on the model-serving routes is answered by app.hot_app before it gets here; the
    # routes stay so that other methods get FastAPI's 405 and the app's route table lists them.
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    app.add_api_route("/metrics/engines", engine_metrics_endpoint, methods=["GET"])
    return app


def _serve_gateway(app: GatewayApp, gateway: Gateway) -> None:
    """Put the built gateway behind the app: its state, the admin API, the console and the
    hot routes."""
    app.state.gateway = gateway
    config = gateway.config
    authenticator = gateway.identity.authenticator
    admin_limit = gateway.guard.admin_dependency
    # With the console on, the admin API also takes a console session (cookie + CSRF token).
    sessions = ConsoleSessions(gateway.redis.client, authenticator, config.console)
    resolve = sessions.resolve_admin if config.console.enabled else None
    app.include_router(
        build_admin_router(
            gateway.identity.store,
            authenticator,
            before_auth=admin_limit,
            audit=gateway.audit,
            resolve=resolve,
        )
    )
    app.include_router(
        build_adapter_router(
            gateway.adapters,
            gateway.identity.store,
            authenticator,
            before_auth=admin_limit,
            audit=gateway.audit,
            resolve=resolve,
        )
    )

    async def bearer_admin(request: Request) -> Principal:
        return await authenticator.resolve_admin(request.headers.get("authorization"))

    app.include_router(
        build_engine_router(
            gateway.pools, gateway.supervisor, resolve or bearer_admin, before_auth=admin_limit
        )
    )
    if gateway.identity.provider_keys is not None:
        app.include_router(
            build_provider_key_router(
                gateway.identity.provider_keys,
                gateway.identity.store,
                authenticator,
                {r.name for r in gateway.config.remotes if r.tenant_keys},
                before_auth=admin_limit,
                audit=gateway.audit,
                resolve=resolve,
            )
        )
    if config.console.enabled:
        app.include_router(
            build_console_router(
                sessions,
                gateway.audit,
                secure_cookies=config.tls is not None,
                before_auth=admin_limit,
            )
        )
    # The two hot routes skip FastAPI's stack, router and dependency machinery (hot_routes.py)
    # but keep the request context and the body-size limit.
    app.hot_app = RequestContextMiddleware(
        BodySizeLimitMiddleware(
            HotRoutes(gateway.complete), max_bytes=gateway.config.max_body_bytes
        ),
        metrics=gateway.metrics,
        in_flight=gateway.in_flight,
    )


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def chat_completions(request: Request) -> Response:
    return await _gateway(request).complete(request, "chat", "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _gateway(request).complete(request, "completion", "/v1/completions")


async def embeddings(request: Request) -> Response:
    return await _gateway(request).complete(request, "embedding", "/v1/embeddings")


async def responses(request: Request) -> Response:
    return await _gateway(request).complete(request, "responses", "/v1/responses")


async def tokenize(request: Request) -> Response:
    return await _gateway(request).complete(request, "tokenize", "/tokenize")


async def detokenize(request: Request) -> Response:
    return await _gateway(request).complete(request, "detokenize", "/detokenize")


async def stored_response(request: Request) -> JSONResponse:
    return await _gateway(request).stored_response(request)


async def list_models(request: Request) -> JSONResponse:
    return await _gateway(request).models(request)


async def health(request: Request) -> JSONResponse:
    _, detail = _gateway(request).readiness()
    detail["status"] = "ok"
    return JSONResponse(detail)


async def ready(request: Request) -> JSONResponse:
    is_ready, detail = _gateway(request).readiness()
    return JSONResponse(detail, status_code=200 if is_ready else 503)


async def metrics_endpoint(request: Request) -> Response:
    metrics: GatewayMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")


async def engine_metrics_endpoint(request: Request) -> Response:
    pools = _gateway(request).pools
    body = await scrape_engines(r for pool in pools for r in pool.replicas)
    return Response(body, media_type="text/plain; version=0.0.4")
