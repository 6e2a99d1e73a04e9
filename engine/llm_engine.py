"""The engine's step loop: requests in, one scheduler step + model step + sampling per call.

(Work in progress: the public API below is the contract of docs/internals.md.)
"""

from __future__ import annotations

from typing import Any

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.stats import EngineStats

__all__ = [
    "CompletionOutput",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "TokenLogprob",
]


class LLMEngine:
    """A synchronous engine: ``add_request`` queues, ``step`` runs one batch, ``abort`` frees.

    Not thread-safe: one thread drives it (AsyncLLMEngine runs it in a dedicated thread).
    """

    config: Any
    model_config: Any
    tokenizer: Any

    @classmethod
    def from_config(cls, config: Any) -> LLMEngine:
        raise NotImplementedError

    def check_request(self, prompt_token_ids: list[int], params: Any) -> None:
        """Raise ValueError (naming the parameter) if the request can never run here."""
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError
