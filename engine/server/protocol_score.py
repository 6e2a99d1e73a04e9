"""The score and rerank bodies the engine server accepts: vLLM's ``POST /v1/score``
(``text_1`` against ``text_2``) and the Cohere/Jina ``POST /v1/rerank`` (a ``query`` against
``documents``), which vLLM also serves at ``/rerank`` and ``/v2/rerank``.

The shapes a client can get wrong are refused here, naming the field: empty texts, pairs that
are neither 1:1, 1:N nor N:N, a ``top_n`` past the number of documents.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from engine.server.protocol import StrictModel
from engine.server.protocol_completions import MAX_EMBEDDING_INPUTS
from portico.contract import MAX_CACHE_SALT_CHARS
from portico.errors import InvalidRequestError

MAX_SCORE_TEXTS = MAX_EMBEDDING_INPUTS  # per side: each text is one engine request


class _ScoreFields(StrictModel):
    """What score and rerank share: the model, vLLM's truncation and the engine-hop fields."""

    model: str
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the last N tokens
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)


def _texts(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


class ScoreRequest(_ScoreFields):
    """``POST /v1/score``: every ``text_1`` scored against its ``text_2`` (one ``text_1``
    against each ``text_2`` when it is a single one), as vLLM pairs them."""

    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2")
    @classmethod
    def _bounded(cls, value: str | list[str]) -> str | list[str]:
        texts = _texts(value)
        if not texts:
            raise ValueError("at least one text must be given")
        if len(texts) > MAX_SCORE_TEXTS:
            raise ValueError(f"at most {MAX_SCORE_TEXTS} texts are allowed")
        if any(not text for text in texts):
            raise ValueError("the texts must not be empty")
        return value

    def pairs(self) -> list[tuple[int, int]]:
        """Indices (into ``texts_1``, ``texts_2``) of the pairs to score, in ``text_2``'s
        order; a 400 naming ``text_2`` when the sides pair neither 1:N nor N:N."""
        num_1, num_2 = len(self.texts_1), len(self.texts_2)
        if num_1 > 1 and num_1 != num_2:
            raise InvalidRequestError(
                f"text_1 and text_2 must pair 1:1, 1:N or N:N; got {num_1} and {num_2} texts.",
                param="text_2",
            )
        return [(0 if num_1 == 1 else i, i) for i in range(num_2)]

    @property
    def texts_1(self) -> list[str]:
        return _texts(self.text_1)

    @property
    def texts_2(self) -> list[str]:
        return _texts(self.text_2)


class RerankDocument(StrictModel):
    """A document given as an object (Cohere's and Jina's other form): its ``text``."""

    text: str = Field(min_length=1)


class RerankRequest(_ScoreFields):
    """``POST /v1/rerank``: ``documents`` ranked by relevance to ``query``; the best ``top_n``
    (all when absent or 0, vLLM's default), each with its ``document`` unless
    ``return_documents`` is false."""

    query: str = Field(min_length=1)
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _bounded(cls, value: list[Any]) -> list[Any]:
        if not value:
            raise ValueError("at least one document must be given")
        if len(value) > MAX_SCORE_TEXTS:
            raise ValueError(f"at most {MAX_SCORE_TEXTS} documents are allowed")
        if any(isinstance(d, str) and not d for d in value):
            raise ValueError("the documents must not be empty")
        return value

    def num_results(self) -> int:
        """How many results to return; a 400 naming ``top_n`` past the number of documents."""
        if self.top_n is not None and self.top_n > len(self.documents):
            raise InvalidRequestError(
                f"top_n ({self.top_n}) must not exceed the number of documents "
                f"({len(self.documents)}).",
                param="top_n",
            )
        return self.top_n or len(self.documents)

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
