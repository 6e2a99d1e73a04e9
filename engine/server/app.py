"""The engine's OpenAI-compatible FastAPI app: ``create_app(engine, settings)``.

Each route reads top to bottom: parse and validate the body once (protocol.py), then hand the
typed request to the serving object. Middlewares, outermost first: API key (401), drain (503 and
in-flight tracking), body size (413). Every error leaves in OpenAI's shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.async_engine import AsyncLLMEngine
from engine.pooling_params import pooler_config_for
from engine.server import metrics as metrics_module
from engine.server.auth import ApiKeyMiddleware
from engine.server.drain import DrainMiddleware, DrainState
from engine.server.engine_requests import ClientDisconnected
from engine.server.kv_events_routes import add_kv_event_routes
from engine.server.lora_routes import add_lora_routes, runtime_updates_allowed
from engine.server.metrics import ServerMetrics
from engine.server.openapi import RERANK_PATHS, openapi_document
from engine.server.protocol import parse_body
from engine.server.protocol_chat import (
    CHAT_UNSUPPORTED,
    VLLM_CHAT_UNSUPPORTED,
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine.server.protocol_completions import (
    COMPLETION_UNSUPPORTED,
    VLLM_COMPLETION_UNSUPPORTED,
    CompletionRequest,
    EmbeddingRequest,
)
from engine.server.protocol_responses import RESPONSES_UNSUPPORTED, ResponsesRequest
from engine.server.protocol_score import RerankRequest, ScoreRequest
from engine.server.serving_chat import ChatServing
from engine.server.serving_completions import CompletionServing
from engine.server.serving_embeddings import EmbeddingServing
from engine.server.serving_engine import OpenAIServing, effective_max_model_len
from engine.server.serving_responses import ResponsesServing
from engine.server.serving_score import ScoreServing
from engine.server.settings import ServerSettings
from engine.server.tracing import EngineTraceMiddleware, EngineTracing
from portico import __version__
from portico.errors import InvalidRequestError, error_body
from portico.http_errors import BodySizeLimitMiddleware, error_response, install_error_handlers

logger = logging.getLogger("portico.engine.server")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def log_capacity(engine: AsyncLLMEngine, max_model_len: int) -> None:
    stats = engine.stats()
    block_size = int(getattr(engine.config, "block_size", 16))
    num_tokens = stats.num_total_blocks * block_size
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d tokens per "
        "request: %.2fx; max_num_seqs=%s",
        stats.num_total_blocks,
        block_size,
        num_tokens,
        max_model_len,
        num_tokens / max_model_len,
        getattr(engine.config, "max_num_seqs", "?"),
    )


def health_problem(engine: AsyncLLMEngine, stall_timeout_s: float) -> str | None:
    """Why the engine is not live, or None: dead loop, or no progress with work pending."""
    if not engine.is_alive:
        return "the engine loop is not running"
    if engine.num_unfinished and time.monotonic() - engine.last_progress > stall_timeout_s:
        return (
            f"the engine loop made no progress for over {stall_timeout_s:g} s with "
            f"{engine.num_unfinished} request(s) pending"
        )
    return None


class EngineRoutes:
    """The engine's HTTP routes as named handlers over one engine and its serving objects.

    ``create_app`` builds one and registers each handler; a handler parses its body once
    (protocol.py) and hands the typed request on. Holds no state beyond what it is given.
    """

    def __init__(self, engine: AsyncLLMEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.name = settings.served_model_name
        max_model_len = effective_max_model_len(engine)
        metrics = ServerMetrics(self.name, max_model_len, engine.stats)
        self.serving = OpenAIServing(engine, self.name, metrics)
        self.chat = ChatServing(
            self.serving,
            settings.tool_call_parser,
            settings.enable_auto_tool_choice,
            settings.media,
        )
        self.completions = CompletionServing(self.serving)
        self.task = str(getattr(engine.config, "task", "auto"))
        pooler = pooler_config_for(
            str(getattr(engine.config, "model", "")), getattr(engine.config, "pooler_config", None)
        )
        self.embeddings = EmbeddingServing(self.serving, pooler)
        model_config = engine.model_config
        self.cross_encoder = bool(getattr(model_config, "is_cross_encoder", False))
        activation = str(getattr(model_config, "score_activation", "sigmoid"))
        self.scores = ScoreServing(self.serving, pooler, self.cross_encoder, activation)
        self.responses = ResponsesServing(self.chat)
        self.drain = DrainState()
        self.started_at = int(time.time())
        numerics = getattr(engine, "numerics", None)
        self.numerics = numerics.as_dict() if numerics is not None else None
        self.document = openapi_document("Portico engine", __version__, self.name)
        self.chat_unsupported = {**CHAT_UNSUPPORTED, **VLLM_CHAT_UNSUPPORTED}
        self.completion_unsupported = {**COMPLETION_UNSUPPORTED, **VLLM_COMPLETION_UNSUPPORTED}

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.engine.start()
        log_capacity(self.engine, self.serving.max_model_len)
        logger.info("serving %r (max_model_len=%d)", self.name, self.serving.max_model_len)
        try:
            yield
        finally:
            await self.engine.shutdown()

    async def on_unexpected(self, request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(exc)

    def check_task(self, endpoint: str, serves: str) -> None:
        """400 for an endpoint the server's ``--task`` turned off (vLLM answers so too), and
        for generation and embeddings on a cross-encoder (it has a score head, no LM head)."""
        if self.cross_encoder and serves != "score":
            raise InvalidRequestError(
                f"The model '{self.name}' is a cross-encoder (a score head, no language-model "
                f"head): it serves /v1/score and /v1/rerank, not the {endpoint} API.",
                param="model",
                code="unsupported_endpoint",
            )
        allowed = ("auto", "embed") if serves == "score" else ("auto", serves)
        if self.task not in allowed:
            raise InvalidRequestError(
                f"This server does not serve the {endpoint} API: it was started with "
                f"--task {self.task}.",
                code="unsupported_endpoint",
            )

    async def chat_completions(self, request: Request) -> Response:
        self.check_task("Chat Completions", "generate")
        req = parse_body(ChatCompletionRequest, await request.body(), self.chat_unsupported)
        try:
            return await self.chat.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def create_completion(self, request: Request) -> Response:
        self.check_task("Completions", "generate")
        req = parse_body(CompletionRequest, await request.body(), self.completion_unsupported)
        try:
            return await self.completions.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def create_embedding(self, request: Request) -> Response:
        self.check_task("Embeddings", "embed")
        req = parse_body(EmbeddingRequest, await request.body())
        try:
            return await self.embeddings.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def create_score(self, request: Request) -> Response:
        self.check_task("Score", "score")
        req = parse_body(ScoreRequest, await request.body())
        try:
            return await self.scores.score(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def create_rerank(self, request: Request) -> Response:
        self.check_task("Rerank", "score")
        req = parse_body(RerankRequest, await request.body())
        try:
            return await self.scores.rerank(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def create_response(self, request: Request) -> Response:
        self.check_task("Responses", "generate")
        req = parse_body(ResponsesRequest, await request.body(), RESPONSES_UNSUPPORTED)
        try:
            return await self.responses.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    def _model_card(self, model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": self.started_at,
            "owned_by": "portico",
            "root": root,
            "parent": parent,
            "max_model_len": self.serving.max_model_len,
        }

    async def list_models(self) -> dict[str, Any]:
        root = str(getattr(self.engine.config, "model", self.name))
        lora = self.serving.lora
        adapters = list(lora.registry.values()) if lora else []
        # The base model's card says how it computes (dtype, activations, why): --dtype auto
        # differs per CPU, and a client comparing outputs or speeds needs to know which ran.
        base = {**self._model_card(self.name, root, None), "numerics": self.numerics}
        return {
            "object": "list",
            "data": [
                base,
                *(self._model_card(a.name, a.path, self.name) for a in adapters),
            ],
        }

    async def health(self) -> JSONResponse:
        problem = health_problem(self.engine, self.settings.stall_timeout_s)
        if problem is not None:
            return JSONResponse(
                error_body(problem, "service_unavailable", code="engine_dead"), status_code=503
            )
        return JSONResponse({"status": "ok"})

    async def ready(self) -> JSONResponse:
        if self.drain.draining:
            reason = "the server is draining"
        elif not self.engine.is_alive:
            reason = "the engine is not running"
        else:
            return JSONResponse({"status": "ready", "model": self.name})
        return JSONResponse(
            error_body(reason, "service_unavailable", code="not_ready"), status_code=503
        )

    async def metrics(self) -> Response:
        return Response(self.serving.metrics.render(), media_type=metrics_module.CONTENT_TYPE)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def openapi(self) -> dict[str, Any]:
        """The contract of these routes (engine/server/openapi.py), for clients and tests."""
        return self.document

    async def tokenize(self, request: Request) -> dict[str, Any]:
        serving = self.serving
        req = parse_body(TokenizeRequest, await request.body())
        if req.model is not None:
            serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
        if req.messages is not None:
            tokens = self.chat.prompt_token_ids(req.messages, req.add_generation_prompt)
        else:
            tokens = list(
                serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            )
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await request.body())
        if req.model is not None:
            self.serving.check_model(req.model)
        self.serving.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.serving.tokenizer.decode(req.tokens)}


def create_app(
    engine: AsyncLLMEngine, settings: ServerSettings, tracing: EngineTracing | None = None
) -> FastAPI:
    """The app serving ``engine`` as ``settings.served_model_name`` (traced with ``tracing``
    when given: engine/server/tracing.py).

    The app starts the engine loop in its lifespan and shuts it down at exit. ``app.state.drain``
    is the :class:`DrainState` a process-level SIGTERM handler flips.
    """
    routes = EngineRoutes(engine, settings)
    app = FastAPI(
        title="Portico engine",
        version=__version__,
        lifespan=routes.lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.drain = routes.drain
    app.state.serving = routes.serving
    install_error_handlers(app)
    app.add_exception_handler(Exception, routes.on_unexpected)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", routes.create_completion, methods=["POST"])
    app.add_api_route("/v1/embeddings", routes.create_embedding, methods=["POST"])
    app.add_api_route("/v1/responses", routes.create_response, methods=["POST"])
    app.add_api_route("/v1/score", routes.create_score, methods=["POST"])
    for path in RERANK_PATHS:
        app.add_api_route(path, routes.create_rerank, methods=["POST"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ready", routes.ready, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/openapi.json", routes.openapi, methods=["GET"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    add_kv_event_routes(app, engine)  # the gateway's prefix index
    lora_flag = bool(getattr(engine.config, "allow_runtime_lora_updating", False))
    if routes.serving.lora is not None and runtime_updates_allowed(lora_flag):
        add_lora_routes(app, routes.serving.lora)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(DrainMiddleware, state=routes.drain)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if tracing is not None:
        routes.serving.metrics.on_finished = tracing.record_timing
        app.add_middleware(EngineTraceMiddleware, tracing=tracing)
    return app
