"""The chat bodies the engine server accepts: ``POST /v1/chat/completions`` (messages, tools,
tool choice) and the tokenizer endpoints (``/tokenize`` takes chat messages too), with the
fields OpenAI and vLLM define that this engine refuses unless their value is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engine.server.protocol import (
    MAX_LOGPROBS,
    VLLM_UNSUPPORTED,
    SamplingFields,
    StrictModel,
    missing_field,
    none_or,
)

# roles whose turn must carry content (an assistant turn may carry tool_calls instead)
CONTENT_ROLES = frozenset({"system", "developer", "user", "tool"})


class TextPart(StrictModel):
    """A text content part of a chat message."""

    type: Literal["text"]
    text: str


class ImageURL(StrictModel):
    """OpenAI's ``image_url`` object: a ``data:image/...;base64,`` URL (``detail`` is
    accepted and has no effect: a LLaVA model sees every image at its one resolution)."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if not value.startswith(("data:image/", "http://", "https://")):
            raise ValueError("expected a data URL (data:image/png;base64,...) or an http(s) URL")
        return value


class ImagePart(StrictModel):
    """An image content part of a user message (a vision model only: engine/multimodal.py)."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionDefinition(StrictModel):
    """A function the model may call: OpenAI's ``tools[].function``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(StrictModel):
    """One entry of ``tools``: only ``function`` tools exist in the chat API."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    """A tool call of a replayed assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """One chat turn. ``developer`` is OpenAI's newer name for ``system`` and is treated so.

    An assistant turn may carry ``tool_calls`` (its content may then be null); a ``tool`` turn is
    the result of one call and names it with ``tool_call_id``.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    refusal: str | None = None  # in replayed assistant turns; history, not instructions
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_absent(cls, value: Any) -> Any:
        # Clients replay a response's message object, which carries refusal/audio/... = null.
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if v is not None}
        return value

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and self.role in CONTENT_ROLES:
            raise missing_field("content")
        if self.role != "user" and self.images():
            raise ValueError("image parts are allowed in user messages only")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(
                        f"content part type {kind!r} is not supported by this engine "
                        "('text' and 'image_url' parts are)"
                    )
        return value

    def text(self) -> str:
        """The message's text (its image parts left out)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts with their index in ``content``, in order."""
        if not isinstance(self.content, list):
            return []
        return [(i, p) for i, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """What the chat template gets as this message's content: its text, or, when it has
        images, transformers' parts list (``{"type": "image"}`` where each image was, in order)
        so the template places the image token where the model expects it."""
        if not self.images() or not isinstance(self.content, list):
            return self.text()
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
            for part in self.content
        ]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # known to OpenAI, refused unless harmless (see CHAT_UNSUPPORTED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    verbosity: Any = None
    # vLLM's chat-only extras this engine does not implement (VLLM_CHAT_UNSUPPORTED)
    best_of: Any = None
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    # vLLM's per-request image processor settings (Qwen2-VL: min_pixels, max_pixels); checked
    # against the served model when the prompt is rendered (engine/models/qwen2_vl.py)
    mm_processor_kwargs: dict[str, Any] | None = None
    include_reasoning: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class TokenizeRequest(StrictModel):
    """``POST /tokenize``: text (``prompt``) or chat ``messages``, as vLLM's endpoint takes."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


# field -> predicate "this value asks for nothing the engine cannot do"
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": none_or([]),
    "function_call": none_or("none"),
    "audio": none_or(),
    "modalities": none_or(["text"]),
    "prediction": none_or(),
    "reasoning_effort": none_or(),
    "web_search_options": none_or(),
    "store": none_or(False),
    "service_tier": none_or("auto", "default"),
    "verbosity": none_or(),
}
VLLM_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **VLLM_UNSUPPORTED,
    "prompt_logprobs": none_or(),  # completions only (with echo, OpenAI's own way too)
    "best_of": none_or(1),
    "echo": none_or(False),
    "add_generation_prompt": none_or(True),
    "continue_final_message": none_or(False),
    "add_special_tokens": none_or(False),  # the chat template adds them
    "documents": none_or(),
    "chat_template": none_or(),
    "chat_template_kwargs": none_or({}),
    "include_reasoning": none_or(True, False),  # no reasoning parser: nothing to include
}
