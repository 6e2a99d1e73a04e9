"""The body of ``POST /v1/responses`` (OpenAI's Responses API), which the server renders onto
a chat request (:mod:`engine.server.serving_responses`), with the fields it refuses unless
their value is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, model_validator

from engine.server.protocol import StrictModel, none_or
from engine.server.structured_fields import JsonSchemaFormat, ResponseFormat
from portico.contract import MAX_CACHE_SALT_CHARS


class ResponseFunctionTool(StrictModel):
    """A function tool of the Responses API (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseNamedToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class ResponseTextFormat(StrictModel):
    """``text.format``: plain text, any JSON object, or a named JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_needs_a_name(self) -> ResponseTextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        inner = JsonSchemaFormat.model_validate(
            {"name": self.name, "description": self.description, "schema": self.json_schema,
             "strict": self.strict}
        )  # fmt: skip
        return ResponseFormat(type="json_schema", json_schema=inner)


class ResponseText(StrictModel):
    format: ResponseTextFormat | None = None
    verbosity: Any = None


class ResponsesRequest(StrictModel):
    """``POST /v1/responses`` (OpenAI's Responses API), rendered onto a chat request.

    ``input`` items are checked by :mod:`engine.server.serving_responses` (it names the bad
    item); ``store`` and ``previous_response_id`` are the gateway's (it keeps responses per
    tenant in Redis and sends the engine the whole conversation).
    """

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponseText | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # Portico's: the gateway expanded previous_response_id, so ``input`` holds the earlier turns
    previous_input_included: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] = "disabled"
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's extras
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    top_k: int | None = Field(default=None, ge=-1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # OpenAI's, refused unless harmless (RESPONSES_UNSUPPORTED)
    reasoning: Any = None
    background: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    stream_options: Any = None


RESPONSES_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "reasoning": none_or({}),
    "background": none_or(False),
    "top_logprobs": none_or(0),
    "max_tool_calls": none_or(),
    "prompt": none_or(),
    "conversation": none_or(),
    "stream_options": none_or({}, {"include_usage": True}, {"include_obfuscation": False}),
}
