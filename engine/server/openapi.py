"""The engine server's OpenAPI document: the contract its routes keep, served at /openapi.json.

The routes read raw bodies (protocol.py validates them once), so FastAPI cannot infer their
schemas; this module writes the document from the same pydantic models, so a field added to a
request model is documented at once. Responses are described as far as clients rely on them:
the objects' required fields, and OpenAI's error shape for every status a route can answer.
The schema-driven tests (tests/hardening/test_openapi_contract.py) hold the server to it.
"""

from __future__ import annotations

from typing import Any

from engine.server.protocol_chat import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.server.protocol_completions import CompletionRequest, EmbeddingRequest
from engine.server.protocol_responses import ResponsesRequest
from engine.server.protocol_score import RerankRequest, ScoreRequest
from portico.errors import ERROR_SCHEMA_DOC

ERROR_SCHEMA = ERROR_SCHEMA_DOC
USAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
FINISH_REASON = {"type": ["string", "null"], "enum": ["stop", "length", "abort", None]}


def _completion_object(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [kind]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": USAGE_SCHEMA,
        },
    }


CHAT_COMPLETION = _completion_object(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"enum": ["assistant"]}, "content": {"type": "string"}},
            },
            "finish_reason": FINISH_REASON,
        },
    },
)
TEXT_COMPLETION = _completion_object(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            "text": {"type": "string"},
            "finish_reason": FINISH_REASON,
        },
    },
)


EMBEDDING_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"enum": ["embedding"]},
                    "index": {"type": "integer", "minimum": 0},
                    "embedding": {
                        "oneOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string"},
                        ]
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}
RESPONSE_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["response"]},
        "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]},
        "model": {"type": "string"},
        "output": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "id"],
                "properties": {"type": {"enum": ["message", "function_call"]}},
            },
        },
        "usage": {
            "type": "object",
            "required": ["input_tokens", "output_tokens", "total_tokens"],
            "properties": {
                "input_tokens": {"type": "integer", "minimum": 0},
                "output_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}


SCORE_LIST: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "model", "data", "usage"],
    "properties": {
        "object": {"enum": ["list"]},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "object", "score"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "object": {"enum": ["score"]},
                    "score": {"type": "number"},
                },
            },
        },
        "usage": USAGE_SCHEMA,
    },
}
RERANK_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["id", "model", "usage", "results"],
    "properties": {
        "usage": {
            "type": "object",
            "required": ["total_tokens"],
            "properties": {"total_tokens": {"type": "integer", "minimum": 0}},
        },
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "relevance_score"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "relevance_score": {"type": "number"},
                    "document": {
                        "type": "object",
                        "required": ["text"],
                        "properties": {"text": {"type": "string"}},
                    },
                },
            },
        },
    },
}
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")  # vLLM serves all three (Jina, Cohere)


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "bad input, naming the parameter",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "body too large",
        503: "draining, or the engine is not running",
    }
    return {
        str(s): {
            "description": reasons[s],
            "content": {"application/json": {"schema": ERROR_SCHEMA}},
        }
        for s in statuses
    }


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(model: type[Any]) -> dict[str, Any]:
    return {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
        },
    }


def _pooled(model: type[Any], schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "requestBody": _body(model),
            "responses": {"200": _json(schema), **_errors(400, 401, 404, 413, 503)},
        }
    }


def _generation(schema: dict[str, Any], model: type[Any]) -> dict[str, Any]:
    ok = _json(schema, "the completion; with stream=true, server-sent events")
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "requestBody": _body(model),
        "responses": {"200": ok, **_errors(400, 401, 404, 413, 503)},
    }


def openapi_document(title: str, version: str, model_name: str) -> dict[str, Any]:
    """The engine server's OpenAPI 3.1 document; ``model`` can only name the served model."""
    models = (
        ChatCompletionRequest,
        CompletionRequest,
        EmbeddingRequest,
        ResponsesRequest,
        TokenizeRequest,
        DetokenizeRequest,
        ScoreRequest,
        RerankRequest,
    )
    components: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        schema["properties"]["model"] = {"enum": [model_name]}
        components[model.__name__] = schema
    plain = {"type": "object"}
    probe = {"200": _json(plain), **_errors(401, 503)}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": _generation(CHAT_COMPLETION, ChatCompletionRequest)},
            "/v1/completions": {"post": _generation(TEXT_COMPLETION, CompletionRequest)},
            "/v1/embeddings": {
                "post": {
                    "requestBody": _body(EmbeddingRequest),
                    "responses": {"200": _json(EMBEDDING_LIST), **_errors(400, 401, 404, 413, 503)},
                }
            },
            "/v1/responses": {"post": _generation(RESPONSE_OBJECT, ResponsesRequest)},
            "/v1/score": _pooled(ScoreRequest, SCORE_LIST),
            **{path: _pooled(RerankRequest, RERANK_OBJECT) for path in RERANK_PATHS},
            "/v1/models": {"get": {"responses": {"200": _json(plain), **_errors(401, 503)}}},
            "/tokenize": {
                "post": {
                    "requestBody": _body(TokenizeRequest),
                    "responses": {"200": _json(plain), **_errors(400, 401, 404, 413, 503)},
                }
            },
            "/detokenize": {
                "post": {
                    "requestBody": _body(DetokenizeRequest),
                    "responses": {"200": _json(plain), **_errors(400, 401, 404, 413, 503)},
                }
            },
            "/health": {"get": {"security": [], "responses": probe}},
            "/ready": {"get": {"security": [], "responses": probe}},
            "/version": {"get": {"responses": {"200": _json(plain), **_errors(401, 503)}}},
        },
    }
