"""The completions and embeddings bodies the engine server accepts (``POST /v1/completions``,
``POST /v1/embeddings``): prompts and inputs as text or token ids, bounded in number, with the
fields OpenAI and vLLM define that this engine refuses unless their value is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator

from engine.server.protocol import (
    MAX_LOGPROBS,
    VLLM_UNSUPPORTED,
    SamplingFields,
    StrictModel,
    TokenIds,
    none_or,
)
from portico.contract import MAX_CACHE_SALT_CHARS

MAX_PROMPTS = 64
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt as a string, a list of strings, or token ids."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # known to OpenAI, refused unless harmless (see COMPLETION_UNSUPPORTED)
    suffix: Any = None
    best_of: Any = None
    prompt_embeds: Any = None  # vLLM's; see VLLM_UNSUPPORTED

    @field_validator("prompt")
    @classmethod
    def _bounded_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("the prompt must not be empty")
            if isinstance(value[0], (str, list)) and len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``; with ``echo``, ``logprobs`` covers the prompt too."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class EmbeddingRequest(StrictModel):
    """``POST /v1/embeddings``: one string, strings, token ids or lists of token ids."""

    model: str
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)

    @field_validator("input")
    @classmethod
    def _bounded_input(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("the input must not be empty")
            if isinstance(value[0], (str, list)) and len(value) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed")
        return value


COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": none_or(""),
    "best_of": none_or(1),
}
VLLM_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **VLLM_UNSUPPORTED,
    "add_special_tokens": none_or(True),
    "prompt_embeds": none_or(),
}
