"""``POST /v1/score`` and ``POST /v1/rerank``: how related two texts are, by the served model.

Two kinds of model score, as vLLM scores them:

* an embedding model (any causal LM here, pooled as ``/v1/embeddings`` pools it): each text is
  embedded once, and a pair's score is the cosine of its two vectors;
* a cross-encoder (a ``*ForSequenceClassification`` checkpoint with one label, e.g. a Llama or
  Qwen2 reranker): each pair is one engine request, its two texts tokenized as one sequence the
  way the tokenizer pairs them (``tokenizer(text_1, text_2)``), the last token's hidden state
  read by the score head, and the logit turned into a relevance in (0, 1) by a sigmoid (vLLM's
  activation for ``num_labels`` = 1; the raw logit where the checkpoint's sentence-transformers
  config names the identity, as vLLM honours it).

Either way every request is prefilled beside the engine's other work, like an embedding.
Usage counts the tokens the engine read: ``prompt_tokens`` for score, ``total_tokens`` for
rerank (Cohere's and Jina's shape has only that).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.pooling_params import PoolerConfig, PoolingParams
from engine.sampling_params import SamplingParams
from engine.server.engine_requests import merge, unless_disconnected
from engine.server.protocol_score import RerankRequest, ScoreRequest
from engine.server.serving_embeddings import fit_pooled_input
from engine.server.serving_engine import OpenAIServing, random_id, tenant_of

# The score head's logit, read from the last token, neither normalised nor cut.
SCORE_HEAD = PoolingParams("LAST", normalize=False, score_head=True)


def sigmoid(x: float) -> float:
    """The logistic function, without overflow for large negative logits."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def cosines(first: list[list[float]], second: list[list[float]]) -> list[float]:
    """The cosine similarity of each ``first[i]`` with ``second[i]`` (0 for a zero vector: it
    points nowhere), in one tensor operation: thousands of pairs of wide vectors in Python
    loops would hold the event loop for seconds."""
    a = torch.tensor(first, dtype=torch.float64)
    b = torch.tensor(second, dtype=torch.float64)
    return [
        float(x)
        for x in torch.nn.functional.cosine_similarity(a, b, dim=1, eps=0.0).nan_to_num(0.0)
    ]


def _param(name: str, num_texts: int, index: int) -> str:
    return name if num_texts == 1 else f"{name}[{index}]"


class ScoreServing:
    """Scores pairs of texts for one model: by cosine of embeddings (``pooler``), or by the
    model's score head when it is a cross-encoder."""

    def __init__(
        self,
        serving: OpenAIServing,
        pooler: PoolerConfig,
        cross_encoder: bool,
        activation: str = "sigmoid",
    ) -> None:
        self.serving = serving
        self.pooler = pooler
        self.cross_encoder = cross_encoder
        self.activate = sigmoid if activation == "sigmoid" else float  # "identity": the logit

    async def score(self, req: ScoreRequest, request: Request) -> Response:
        self.serving.check_model(req.model)
        pairs = req.pairs()
        scores, num_tokens = await self.scores(
            req, (req.texts_1, "text_1"), (req.texts_2, "text_2"), pairs, request
        )
        return JSONResponse(
            {
                "id": random_id("score"),
                "object": "list",
                "created": self.serving.created(),
                "model": self.serving.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {
                    "prompt_tokens": num_tokens,
                    "completion_tokens": 0,
                    "total_tokens": num_tokens,
                },
            }
        )

    async def rerank(self, req: RerankRequest, request: Request) -> Response:
        self.serving.check_model(req.model)
        num_results = req.num_results()
        documents = req.texts
        pairs = [(0, i) for i in range(len(documents))]
        scores, num_tokens = await self.scores(
            req, ([req.query], "query"), (documents, "documents"), pairs, request
        )
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:num_results]
        results: list[dict[str, Any]] = []
        for i in ranked:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return JSONResponse(
            {
                "id": random_id("rerank"),
                "model": self.serving.model_name,
                "usage": {"total_tokens": num_tokens},
                "results": results,
            }
        )

    async def scores(
        self,
        req: ScoreRequest | RerankRequest,
        side_1: tuple[list[str], str],
        side_2: tuple[list[str], str],
        pairs: list[tuple[int, int]],
        request: Request,
    ) -> tuple[list[float], int]:
        """The score of each pair (indices into the two sides' texts) and the tokens read."""
        if self.cross_encoder:
            prompts = [self.pair_ids(req, side_1, side_2, a, b) for a, b in pairs]
            params = SamplingParams(max_tokens=1, temperature=0.0, pooling=SCORE_HEAD)
            outputs = await self.run(req, prompts, params, request)
            return [self.activate(out[0]) for out in outputs], sum(len(ids) for ids in prompts)
        prompts = [
            self.text_ids(req, text, _param(name, len(texts), i))
            for texts, name in (side_1, side_2)
            for i, text in enumerate(texts)
        ]
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooler.params())
        vectors = await self.run(req, prompts, params, request)
        first, second = vectors[: len(side_1[0])], vectors[len(side_1[0]) :]
        scores = cosines([first[a] for a, _ in pairs], [second[b] for _, b in pairs])
        return scores, sum(len(ids) for ids in prompts)

    def pair_ids(
        self,
        req: ScoreRequest | RerankRequest,
        side_1: tuple[list[str], str],
        side_2: tuple[list[str], str],
        a: int,
        b: int,
    ) -> list[int]:
        """A pair as one sequence, the way the model's tokenizer joins two texts."""
        ids = list(self.serving.tokenizer(side_1[0][a], side_2[0][b])["input_ids"])
        param = _param(side_2[1], len(side_2[0]), b)
        return fit_pooled_input(self.serving, ids, req.truncate_prompt_tokens, param)

    def text_ids(self, req: ScoreRequest | RerankRequest, text: str, param: str) -> list[int]:
        """One text to embed, tokenized as ``/v1/embeddings`` tokenizes it."""
        ids = list(self.serving.tokenizer.encode(text))
        return fit_pooled_input(self.serving, ids, req.truncate_prompt_tokens, param)

    async def run(
        self,
        req: ScoreRequest | RerankRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        request: Request,
    ) -> list[list[float]]:
        """Each prompt's pooled output (a vector, or the score head's logits), in order."""
        submitted = self.serving.submit_all(
            [(ids, params) for ids in prompts], req, random_id("score"), tenant_of(request.headers)
        )

        async def collect() -> list[list[float]]:
            pooled: dict[int, list[float]] = {}
            async for index, out in merge(submitted):
                if out.embedding is not None:
                    pooled[index] = out.embedding
            return [pooled[i] for i in range(len(prompts))]

        return await unless_disconnected(collect(), request)
