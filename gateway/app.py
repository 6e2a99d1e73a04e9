"""The gateway application: ``create_app(config)`` builds it, its lifespan starts and stops
everything it holds, and each route reads top to bottom as the request path of
ARCHITECTURE.md: request id -> authenticate -> parse -> authorize + route -> admit -> forward
(retries) -> relay -> settle + release -> record usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
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
from gateway.dataplane.engine_metrics import scrape_engines
from gateway.dataplane.fields import parse_fields
from gateway.dataplane.hot_routes import GatewayApp, HotRoutes
from gateway.dataplane.pool import Pool, Replica
from gateway.dataplane.proxy import Exchange, LocalUpstream, RelayResponse, upstream_body
from gateway.dataplane.remote import RemoteUpstream
from gateway.dataplane.request_context import (
    CTX_KEY,
    InFlight,
    RequestContext,
    RequestContextMiddleware,
)
from gateway.dataplane.retry import RetryPolicy, load_retry_policy
from gateway.dataplane.routing import Router, load_routing_policy
from gateway.dataplane.supervisor import EngineProcess, Supervisor, engine_argv
from gateway.dataplane.transport import LeanTransport
from gateway.identity.admin import build_admin_router
from gateway.identity.auth import Identity, open_identity
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from gateway.tls import AdminClientCertGuard
from portico.errors import (
    AuthenticationError,
    BodySizeLimitMiddleware,
    ServiceUnavailableError,
    install_error_handlers,
)

log = logging.getLogger("portico.gateway")

FAILED_AUTH_MEMORY_S = 300.0
GC_YOUNG_THRESHOLD = 10_000
MAX_FAILED_AUTH_ADDRESSES = 10_000


@dataclass(eq=False)
class Gateway:
    """Everything one gateway process holds while it serves; built in the app's lifespan."""

    config: GatewayConfig
    metrics: GatewayMetrics
    in_flight: InFlight
    identity: Identity | None = None
    admission: Admission | None = None
    guard: AbuseGuard | None = None
    router: Router | None = None
    counter: PromptCounter = field(default_factory=lambda: PromptCounter({}))
    upstreams: dict[str, Any] = field(default_factory=dict)  # model -> Local/RemoteUpstream
    pools: list[Pool] = field(default_factory=list)
    supervisor: Supervisor | None = None
    draining: bool = False
    runtime_dir: Path | None = None
    usage: UsageRecorder | None = None
    limiter_pipe: RedisPipe | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _own_runtime_dir: tempfile.TemporaryDirectory[str] | None = None
    _failed_auth: dict[str, float] = field(default_factory=dict)  # address -> last failure

    # ------------------------------------------------------------------ readiness

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: not draining, every pool has a replica, and the store is up, or down under
        a policy that still serves (``local``/``open``; under ``closed`` nothing is admitted).
        ``redis`` in the detail is what the timed probe last found (admission.start_watch)."""
        pools = {p.name: sum(1 for r in p.replicas if r.available) for p in self.pools}
        redis_up = self.admission is not None and self.admission.redis_up
        serves_without_redis = self.config.admission.redis_down_policy != "closed"
        ready = (
            not self.draining
            and self.router is not None
            and all(pools.values())
            and (redis_up or serves_without_redis)
        )
        detail: dict[str, Any] = {
            "status": "ready" if ready else "not_ready",
            "draining": self.draining,
            "healthy_replicas": pools,
            "redis": "up" if redis_up else "down",
            "redis_down_policy": self.config.admission.redis_down_policy,
        }
        if self.supervisor is not None:
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
        assert self.identity is not None and self.guard is not None  # set before serving
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
        """``/v1/chat/completions`` and ``/v1/completions``, top to bottom."""
        ctx: RequestContext = request.scope[CTX_KEY]
        if self.draining:
            raise ServiceUnavailableError(
                "The gateway is shutting down; retry elsewhere.",
                code="draining",
                headers={"retry-after": "1"},
            )
        principal = await self.authenticate(request)
        ctx.tenant = principal.tenant_id
        raw = await request.body()
        fields = parse_fields(raw, kind)
        decision = self.router.route(fields, principal)  # type: ignore[union-attr]  # 403 / 404
        ctx.model, ctx.tier = decision.model, decision.tier
        upstream = self.upstreams[decision.model]
        prompt_tokens = self.counter.count(decision.model, fields)
        ticket = await self.admit(
            principal, decision.model, prompt_tokens, fields.max_tokens, fields.num_outputs
        )
        try:
            if ticket.max_tokens is not None:  # the client set none: send what was reserved
                fields.body["max_tokens"] = ticket.max_tokens
            payload = upstream_body(
                raw, fields, decision.model, principal.cache_salt, ticket.max_tokens
            )
            exchange: Exchange = await upstream.exchange(
                path, payload, fields, ctx.request_id, decision.prefix_key
            )
        except BaseException:
            await self.admission.release(ticket)  # type: ignore[union-attr]
            raise
        ctx.upstream_s = exchange.upstream_s
        headers = {**ticket.headers, "x-portico-route": decision.header}

        async def finish() -> None:
            await self.settle(ticket, principal, decision.model, exchange)

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

    async def admit(
        self,
        principal: Principal,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        num_outputs: int = 1,
    ) -> Ticket:
        try:
            return await self.admission.admit(  # type: ignore[union-attr]
                principal, model, prompt_tokens, max_tokens, num_outputs
            )
        except LimitExceededError as exc:
            self.metrics.rate_limited.labels(exc.limit).inc()
            raise
        except InsufficientQuotaError:
            self.metrics.rate_limited.labels("monthly_token_budget").inc()
            raise

    async def settle(
        self, ticket: Ticket, principal: Principal, model: str, exchange: Exchange
    ) -> None:
        """Settle with the real usage (or release the slot when there is none); record it."""
        admission = self.admission
        recorder = self.usage
        assert admission is not None and recorder is not None
        usage = exchange.usage
        try:
            if usage.reported:  # usage is summed in memory and written in batches
                recorder.record(
                    principal.tenant_id, model, usage.prompt_tokens, usage.completion_tokens
                )
                await admission.settle(ticket, usage.prompt_tokens, usage.completion_tokens)
        except Exception as exc:  # accounting must never break a finished response
            log.warning("settling request usage failed: %s", exc)
        finally:
            await admission.release(ticket)

    async def models(self, request: Request) -> JSONResponse:
        principal = await self.authenticate(request)
        request.scope[CTX_KEY].tenant = principal.tenant_id
        names = self.router.visible_models(principal)  # type: ignore[union-attr]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "portico"} for n in names]
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------------ start / stop

    async def start(self, env: Mapping[str, str] | None) -> None:
        config = self.config
        self.identity = await open_identity(config.redis, config.auth, env)
        if config.admission.redis_down_policy != "closed":  # closed: an outage refuses all
            self.identity.authenticator.keep_outage_copy(config.auth.outage_copy_seconds)
        redis_url = self.identity.redis_url
        self.usage = UsageRecorder(self.identity.store)
        self.usage.start()
        # Admission's two scripts per request go over one pipelined connection (redis_pipe.py);
        # redis-py's per-command cost was the largest single share of the gateway's CPU.
        self.limiter_pipe = RedisPipe.from_client(self.identity.redis)
        limiter = RedisLimiter(
            self.identity.redis,
            budget_ttl_s=config.admission.budget_key_ttl_seconds,
            pipe=self.limiter_pipe,
        )
        self.admission = Admission(
            self.identity.redis, config.admission, registry=self.metrics.registry, limiter=limiter
        )
        self.admission.start_watch()
        self.guard = AbuseGuard(redis_url, config.admission.abuse, registry=self.metrics.registry)
        retry = load_retry_policy(config.policies_dir / "retry.yaml")
        routing = load_routing_policy(config.policies_dir / "routing.yaml")
        processes = self._build_local(retry, routing.affinity_slack)
        for spec in config.remotes:
            self.upstreams[spec.name] = RemoteUpstream(spec, retry, self.metrics)
        self.router = Router(
            routing, set(self.upstreams), strict=config.policies_dir.resolve() != PACKAGED_POLICIES
        )
        self.supervisor = Supervisor(
            processes,
            backoff_base_s=config.supervisor.backoff_base_s,
            backoff_max_s=config.supervisor.backoff_max_s,
            stable_after_s=config.supervisor.stable_after_s,
            on_state=lambda p: self.metrics.engine_up.labels(p.name).set(
                1 if p.state == "ready" else 0
            ),
            on_restart=lambda p: self.metrics.engine_restarts.labels(p.name).inc(),
        )
        for pool in self.pools:
            self._tasks.append(asyncio.create_task(pool.run_prober()))
        timeout = max((e.startup_timeout_s for e in config.engines), default=0.0)
        tokenizers, all_ready = await asyncio.gather(
            self._load_tokenizers(), self.supervisor.start(ready_timeout=timeout)
        )
        self.counter = PromptCounter(tokenizers)
        if not all_ready:
            log.error("not every engine became ready in %.0f s; serving what is up", timeout)
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

    def _build_local(self, retry: RetryPolicy, slack: int) -> list[EngineProcess]:
        if self.config.runtime_dir is not None:
            self.runtime_dir = self.config.runtime_dir
            self.runtime_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._own_runtime_dir = tempfile.TemporaryDirectory(prefix="portico-")
            self.runtime_dir = Path(self._own_runtime_dir.name)
        processes = []
        for spec in self.config.engines:
            replicas = []
            for i in range(spec.replicas):
                name = f"{spec.name}-{i}"
                uds = self.runtime_dir / f"{name}.sock"
                transport = LeanTransport(uds=str(uds))
                timeout = httpx.Timeout(retry.read_timeout_s, connect=retry.connect_timeout_s)
                client = httpx.AsyncClient(
                    transport=transport, base_url="http://engine", timeout=timeout
                )
                replica = Replica(name, client, transport, timeout.as_dict())
                replicas.append(replica)
                processes.append(
                    EngineProcess(
                        name,
                        self._argv(spec, name, uds),
                        replica,
                        socket_path=uds,
                        env=dict(spec.env),
                        startup_timeout_s=spec.startup_timeout_s,
                    )
                )
            pool = Pool(
                spec.name,
                replicas,
                slack=slack,
                eject_after_failures=retry.eject_after_failures,
                eject_cooldown_s=retry.eject_cooldown_s,
                on_eject=self._count_ejection,
            )
            self.pools.append(pool)
            self.upstreams[spec.name] = LocalUpstream(pool, retry, self.metrics)
        return processes

    def _count_ejection(self, replica: Replica) -> None:
        pool = replica.name.rsplit("-", 1)[0]
        self.metrics.ejections.labels(pool, replica.name).inc()

    @staticmethod
    def _argv(spec: EngineSpec, name: str, uds: Path) -> list[str]:
        if spec.command is None:
            return engine_argv(spec.model, spec.name, uds, list(spec.args))
        values = {"uds": str(uds), "model": spec.model, "name": spec.name, "replica": name}
        return [part.format(**values) for part in spec.command] + list(spec.args)

    async def _load_tokenizers(self) -> dict[str, Any]:
        wanted = [
            e
            for e in self.config.engines
            if e.count_tokens_with == "tokenizer" and e.command is None
        ]
        loaded = await asyncio.gather(*(asyncio.to_thread(load_tokenizer, e.model) for e in wanted))
        return {e.name: tok for e, tok in zip(wanted, loaded, strict=True) if tok is not None}

    async def stop(self) -> None:
        """Stop the engines (they drain), then close clients, admission and identity."""
        if self.supervisor is not None:
            await self.supervisor.stop(self.config.supervisor.stop_timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self.pools:
            for replica in pool.replicas:
                await replica.client.aclose()
        if self.usage is not None:
            await self.usage.aclose()  # after the engines drained: every request is counted
        if self.admission is not None:
            await self.admission.aclose()
        if self.limiter_pipe is not None:
            await self.limiter_pipe.aclose()
        if self.identity is not None:
            await self.identity.aclose()
        if self._own_runtime_dir is not None:
            with contextlib.suppress(OSError):
                self._own_runtime_dir.cleanup()


def create_app(config: GatewayConfig, *, env: Mapping[str, str] | None = None) -> FastAPI:
    """The gateway as an ASGI app; its lifespan starts Redis/identity, engines and upstreams.

    ``app.state.gateway`` is the :class:`Gateway` (the server's drain logic uses it).
    """
    metrics = GatewayMetrics()
    gw = Gateway(config, metrics, InFlight())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await gw.start(env if env is not None else os.environ)
            assert gw.identity is not None and gw.guard is not None
            app.include_router(
                build_admin_router(
                    gw.identity.store,
                    gw.identity.authenticator,
                    before_auth=gw.guard.admin_dependency,
                )
            )
            yield
        finally:
            await gw.stop()

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
    app.state.gateway = gw
    install_error_handlers(app)
    # The two hot routes skip FastAPI's stack, router and dependency machinery (hot_routes.py)
    # but keep the request context and the body-size limit.
    app.hot_app = RequestContextMiddleware(
        BodySizeLimitMiddleware(HotRoutes(gw.complete), max_bytes=config.max_body_bytes),
        metrics=metrics,
        in_flight=gw.in_flight,
    )
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.tls is not None and config.tls.admin_requires_client_cert:
        app.add_middleware(AdminClientCertGuard)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, in_flight=gw.in_flight)

    # POST on these two is answered by app.hot_app before it gets here; the routes stay so that
    # other methods get FastAPI's 405 and the app's route table lists them.
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gw.complete(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.complete(request, "completion", "/v1/completions")

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return await gw.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        _, detail = gw.readiness()
        detail["status"] = "ok"
        return JSONResponse(detail)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        is_ready, detail = gw.readiness()
        return JSONResponse(detail, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/metrics/engines")
    async def engine_metrics_endpoint() -> Response:
        body = await scrape_engines(r for pool in gw.pools for r in pool.replicas)
        return Response(body, media_type="text/plain; version=0.0.4")

    return app
