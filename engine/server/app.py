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
from engine.server import metrics as metrics_module
from engine.server.auth import ApiKeyMiddleware
from engine.server.drain import DrainMiddleware, DrainState
from engine.server.engine_requests import ClientDisconnected
from engine.server.lora_routes import add_lora_routes, runtime_updates_allowed
from engine.server.metrics import ServerMetrics
from engine.server.openapi import openapi_document
from engine.server.protocol import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    VLLM_CHAT_UNSUPPORTED,
    VLLM_COMPLETION_UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from engine.server.serving_chat import ChatServing
from engine.server.serving_completions import CompletionServing
from engine.server.serving_engine import OpenAIServing, effective_max_model_len
from engine.server.settings import ServerSettings
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


def create_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The app serving ``engine`` as ``settings.served_model_name``.

    The app starts the engine loop in its lifespan and shuts it down at exit. ``app.state.drain``
    is the :class:`DrainState` a process-level SIGTERM handler flips.
    """
    name = settings.served_model_name
    max_model_len = effective_max_model_len(engine)
    serving = OpenAIServing(engine, name, ServerMetrics(name, max_model_len, engine.stats))
    chat = ChatServing(serving, settings.tool_call_parser, settings.enable_auto_tool_choice)
    completions = CompletionServing(serving)
    drain = DrainState()
    started_at = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log_capacity(engine, serving.max_model_len)
        logger.info("serving %r (max_model_len=%d)", name, serving.max_model_len)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(
        title="Portico engine",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.drain = drain
    app.state.serving = serving
    install_error_handlers(app)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(exc)

    app.add_exception_handler(Exception, on_unexpected)

    chat_unsupported = {**CHAT_UNSUPPORTED, **VLLM_CHAT_UNSUPPORTED}
    completion_unsupported = {**COMPLETION_UNSUPPORTED, **VLLM_COMPLETION_UNSUPPORTED}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body(), chat_unsupported)
        try:
            return await chat.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body(), completion_unsupported)
        try:
            return await completions.create(req, request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": started_at,
                    "owned_by": "portico",
                    "root": str(getattr(engine.config, "model", name)),
                    "parent": None,
                    "max_model_len": serving.max_model_len,
                },
                *(
                    {
                        "id": lora.name,
                        "object": "model",
                        "created": started_at,
                        "owned_by": "portico",
                        "root": lora.path,
                        "parent": name,
                        "max_model_len": serving.max_model_len,
                    }
                    for lora in list(serving.lora.registry.values() if serving.lora else ())
                ),
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = health_problem(engine, settings.stall_timeout_s)
        if problem is not None:
            return JSONResponse(
                error_body(problem, "service_unavailable", code="engine_dead"), status_code=503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if drain.draining:
            reason = "the server is draining"
        elif not engine.is_alive:
            reason = "the engine is not running"
        else:
            return JSONResponse({"status": "ready", "model": name})
        return JSONResponse(
            error_body(reason, "service_unavailable", code="not_ready"), status_code=503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=metrics_module.CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    document = openapi_document("Portico engine", __version__, name)

    @app.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        """The contract of these routes (engine/server/openapi.py), for clients and tests."""
        return document

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await request.body())
        if req.model is not None:
            serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("Give exactly one of 'prompt' or 'messages'.", param="prompt")
        if req.messages is not None:
            tokens = chat.prompt_token_ids(req.messages, req.add_generation_prompt)
        else:
            tokens = list(
                serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            )
        return {"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await request.body())
        if req.model is not None:
            serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    lora_flag = bool(getattr(engine.config, "allow_runtime_lora_updating", False))
    if serving.lora is not None and runtime_updates_allowed(lora_flag):
        add_lora_routes(app, serving.lora)

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(DrainMiddleware, state=drain)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app
