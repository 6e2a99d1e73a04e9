"""``POST /v1/embeddings``: one pooling engine request per input, in OpenAI's shape.

Each input becomes an engine request whose prompt is prefilled beside the other work of the
engine and whose final hidden states are pooled (engine/pooling.py). ``encoding_format``
``base64`` is the little-endian float32 bytes, base64-encoded, as OpenAI sends them (and what
the OpenAI SDK asks for by default). ``dimensions`` is allowed only for a Matryoshka model.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.pooling_params import PoolerConfig
from engine.sampling_params import SamplingParams
from engine.server.engine_requests import merge, unless_disconnected
from engine.server.protocol_completions import EmbeddingRequest
from engine.server.serving_engine import OpenAIServing, random_id, tenant_of
from portico.errors import InvalidRequestError


def encode_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def fit_pooled_input(
    serving: OpenAIServing, ids: list[int], truncate_prompt_tokens: int | None, param: str
) -> list[int]:
    """``ids`` cut to their last ``truncate_prompt_tokens``, or a 400 naming ``param`` when
    they do not fit the context of a pooling request (which samples one token)."""
    if truncate_prompt_tokens is not None:
        ids = ids[-truncate_prompt_tokens:]
    limit = serving.max_model_len - 1
    if len(ids) > limit:
        raise InvalidRequestError(
            f"This model's maximum input length is {limit} tokens. However, your "
            f"input has {len(ids)} tokens. Please reduce the length of the input "
            "(or set truncate_prompt_tokens).",
            param=param,
            code="context_length_exceeded",
        )
    return ids


class EmbeddingServing:
    """Answers embeddings for one model with the model's pooling (``pooler``)."""

    def __init__(self, serving: OpenAIServing, pooler: PoolerConfig) -> None:
        self.serving = serving
        self.pooler = pooler

    def inputs(self, req: EmbeddingRequest) -> list[list[int]]:
        """Token ids of every input (truncated from the left to ``truncate_prompt_tokens``)."""
        tokenizer = self.serving.tokenizer
        items: list[str | list[int]]
        if isinstance(req.input, str):
            items = [req.input]
        elif isinstance(req.input[0], int):
            items = [cast(list[int], req.input)]
        else:
            items = list(cast(list[str | list[int]], req.input))
        prompts = []
        for index, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input[{index}]"
            if isinstance(item, str):
                ids = list(tokenizer.encode(item, add_special_tokens=req.add_special_tokens))
                if not ids:
                    raise InvalidRequestError("The input must not be empty.", param=param)
            else:
                self.serving.check_token_ids(item, param)
                ids = list(item)
            prompts.append(fit_pooled_input(self.serving, ids, req.truncate_prompt_tokens, param))
        return prompts

    async def create(self, req: EmbeddingRequest, request: Request) -> Response:
        serving = self.serving
        tenant = tenant_of(request.headers)
        serving.check_model(req.model)
        if req.dimensions is not None and not self.pooler.allows_dimensions(req.dimensions):
            raise InvalidRequestError(
                f"This model does not support 'dimensions' = {req.dimensions} (it is not a "
                "Matryoshka model, or that size is not one it was trained for).",
                param="dimensions",
            )
        prompts = self.inputs(req)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, pooling=self.pooler.params(req.dimensions)
        )
        request_id = random_id("embd")
        jobs = [(ids, params) for ids in prompts]
        submitted = serving.submit_all(jobs, req, request_id, tenant)
        body = await unless_disconnected(self.collect(req, prompts, submitted), request)
        return JSONResponse(body)

    async def collect(
        self, req: EmbeddingRequest, prompts: list[list[int]], submitted: list[Any]
    ) -> dict[str, Any]:
        vectors: dict[int, list[float]] = {}
        async for index, out in merge(submitted):
            if out.embedding is not None:
                vectors[index] = out.embedding
        data = []
        for index in range(len(prompts)):
            vector = vectors[index]
            data.append(
                {
                    "object": "embedding",
                    "index": index,
                    "embedding": (
                        encode_base64(vector) if req.encoding_format == "base64" else vector
                    ),
                }
            )
        num_tokens = sum(len(ids) for ids in prompts)
        return {
            "object": "list",
            "data": data,
            "model": self.serving.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
