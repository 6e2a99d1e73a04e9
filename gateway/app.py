"""The gateway application: ``create_app(config)`` builds it (middleware, the route table), its
lifespan starts the :class:`~gateway.request_path.Gateway` (:mod:`gateway.lifecycle`) and stops
it, and the routes hand each request to it (the request path is :mod:`gateway.request_path`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from gateway.batch.batch_routes import build_batch_router
from gateway.config import GatewayConfig
from gateway.console.routes import build_console_router
from gateway.console.sessions import ConsoleSessions
from gateway.fleet.adapter_admin import build_adapter_router
from gateway.fleet.engine_admin import build_engine_router
from gateway.fleet.engine_metrics import scrape_engines
from gateway.identity.admin import build_admin_router
from gateway.identity.principal import Principal
from gateway.identity.provider_keys import build_provider_key_router
from gateway.lifecycle import start_gateway
from gateway.metrics import GatewayMetrics
from gateway.relay.hot_routes import GatewayApp, hot_stack
from gateway.relay.request_context import InFlight, RequestContextMiddleware
from gateway.request_path import Gateway
from gateway.tls import AdminClientCertGuard
from portico.http_errors import BodySizeLimitMiddleware, install_error_handlers

# a multipart upload's boundaries and part headers around the file's bytes
UPLOAD_OVERHEAD_BYTES = 64 * 1024


def create_app(config: GatewayConfig, *, env: Mapping[str, str] | None = None) -> FastAPI:
    """The gateway as an ASGI app; its lifespan builds the :class:`Gateway` and stops it.

    ``app.state.gateway`` is the :class:`Gateway` once the lifespan has started (the server's
    drain logic and every route read it there).
    """
    metrics = GatewayMetrics()
    in_flight = InFlight()

    @contextlib.asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        gateway = await start_gateway(
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
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=config.max_body_bytes,
        path_limits={"/v1/files": config.batches.max_file_bytes + UPLOAD_OVERHEAD_BYTES},
    )
    if config.tls is not None and config.tls.admin_requires_client_cert:
        app.add_middleware(AdminClientCertGuard)
    app.add_middleware(RequestContextMiddleware, metrics=metrics, in_flight=in_flight)
    # POST on the model-serving routes is answered by app.hot_app before it gets here; the
    # routes stay so that other methods get FastAPI's 405 and the app's route table lists them.
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/score", score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", list_models, methods=["GET"])  # retrieve
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
            prices=gateway.prices,
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

    runner = gateway.batch_runner
    app.include_router(
        build_batch_router(
            gateway.files,
            gateway.batches,
            config.batches,
            gateway.authenticate,
            runner.wake if runner is not None else lambda: None,
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
    app.hot_app = hot_stack(
        gateway.complete, gateway.config.max_body_bytes, gateway.metrics, gateway.in_flight
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


async def score(request: Request) -> Response:
    return await _gateway(request).complete(request, "score", "/v1/score")


async def rerank(request: Request) -> Response:
    return await _gateway(request).complete(request, "rerank", request.url.path)


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
