"""The OpenAI request bodies the engine server accepts, validated once at the edge.

Every body is a strict pydantic model with ``extra="forbid"``: an unknown field is a 400 that
names it, as OpenAI's API answers. Fields that OpenAI defines but this engine cannot honour yet
(audio, the legacy ``functions``, ...) are listed in
:data:`CHAT_UNSUPPORTED` / :data:`COMPLETION_UNSUPPORTED` with the values that are harmless
(``None``, ``"none"``, ``[]``): any other value is a 400 naming the field, never a silent ignore.

:func:`parse_body` is the one entry: raw bytes in, a typed request out, or an
:class:`~portico.errors.InvalidRequestError` whose message names the first bad parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.server.structured_fields import (
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputsField,
)
from portico.errors import InvalidRequestError

MAX_N = 16
MAX_STOP_SEQUENCES = 32
MAX_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StrictModel(BaseModel):
    """Base of every request body: unknown fields and loose type coercions are rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """``stream_options``: OpenAI's ``include_usage`` (a final chunk carrying usage) and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``, every chunk carries the usage so far:
    benchmarks such as guidellm count tokens from it)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(StrictModel):
    """A text content part of a chat message (the only part type this engine reads)."""

    type: Literal["text"]
    text: str


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
    content: str | list[TextPart] | None = None
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
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content part type {kind!r} is not supported by this engine "
                        "(only 'text' parts are)"
                    )
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(StrictModel):
    """The sampling parameters chat and completions share (OpenAI's plus vLLM's extras)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # structured outputs (engine/server/structured_fields.py): OpenAI's, vLLM's, vLLM's older
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # annotations that change nothing the engine does
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras this engine does not implement: refused unless harmless (VLLM_UNSUPPORTED)
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep the prompt's last N
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    add_special_tokens: Any = None
    request_id: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's meaning: usage on every chunk only when ``include_usage`` is asked too."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


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
    mm_processor_kwargs: Any = None
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


TokenIds = Annotated[list[int], Field(min_length=1)]


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
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
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
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # OpenAI's, refused unless harmless (RESPONSES_UNSUPPORTED)
    reasoning: Any = None
    background: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    stream_options: Any = None


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


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


# field -> predicate "this value asks for nothing the engine cannot do"
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "audio": _none_or(),
    "modalities": _none_or(["text"]),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "web_search_options": _none_or(),
    "store": _none_or(False),
    "service_tier": _none_or("auto", "default"),
    "verbosity": _none_or(),
}
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _none_or(""),
    "best_of": _none_or(1),
}

# Fields vLLM's OpenAI server accepts that this engine does not implement. A client that sends
# the value meaning "off" (vLLM's default) is served; any other value is a 400 that says the
# field is not supported, so a vLLM client learns why instead of reading "unrecognized".
VLLM_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _none_or(False),
    "length_penalty": _none_or(1, 1.0),
    "spaces_between_special_tokens": _none_or(True),
    "allowed_token_ids": _none_or(),
    "bad_words": _none_or([]),
    "logits_processors": _none_or(),
    "return_tokens_as_token_ids": _none_or(False),
    "return_token_ids": _none_or(False),
    "request_id": _none_or(),
    "kv_transfer_params": _none_or(),
    "vllm_xargs": _none_or(),
}
VLLM_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **VLLM_UNSUPPORTED,
    "prompt_logprobs": _none_or(),  # completions only (with echo, OpenAI's own way too)
    "best_of": _none_or(1),
    "echo": _none_or(False),
    "add_generation_prompt": _none_or(True),
    "continue_final_message": _none_or(False),
    "add_special_tokens": _none_or(False),  # the chat template adds them
    "documents": _none_or(),
    "chat_template": _none_or(),
    "chat_template_kwargs": _none_or({}),
    "mm_processor_kwargs": _none_or({}),
    "include_reasoning": _none_or(True, False),  # no reasoning parser: nothing to include
}
RESPONSES_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "reasoning": _none_or({}),
    "background": _none_or(False),
    "top_logprobs": _none_or(0),
    "max_tool_calls": _none_or(),
    "prompt": _none_or(),
    "conversation": _none_or(),
    "stream_options": _none_or({}, {"include_usage": True}, {"include_obfuscation": False}),
}
VLLM_COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **VLLM_UNSUPPORTED,
    "add_special_tokens": _none_or(True),
    "prompt_embeds": _none_or(),
}

RequestT = TypeVar("RequestT", bound=StrictModel)


def parse_body(
    model_cls: type[RequestT],
    raw: bytes,
    unsupported: dict[str, Callable[[Any], bool]] | None = None,
) -> RequestT:
    """Validate a raw JSON body into ``model_cls`` or raise a 400 naming the bad parameter."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. The body must be a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    for name, harmless in (unsupported or {}).items():
        if name in data and not harmless(data[name]):
            raise InvalidRequestError(
                f"'{name}' is not supported by this engine yet.",
                param=name,
                code="unsupported_parameter",
            )
    # OpenAI treats an explicit null as "not given": every field falls back to its default.
    data = {key: value for key, value in data.items() if value is not None}
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise InvalidRequestError(message, param=param) from None


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[TextPart]", "none", "int", "float"):
            continue  # pydantic's union-branch markers, not part of the parameter's path
        elif "[" in part or part.startswith("function-"):
            continue
        else:
            path += f".{part}" if path else part
    return path


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """One short sentence for the most useful error of pydantic's list, and the parameter."""
    errors = exc.errors(include_url=False, include_input=False)
    # A union reports one error per branch; the one deepest in the input is the most telling.
    first = max(errors, key=lambda e: len(e["loc"])) if errors else None
    if first is None:
        return "Invalid request body.", None
    param = _param_path(tuple(first["loc"])) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind.endswith("_type") and sum(_param_path(tuple(e["loc"])) == param for e in errors) > 1:
        return f"Invalid type for '{param}'.", param  # every branch of a union refused it
    msg = str(first["msg"]).removeprefix("Value error, ")
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request: {msg}."), param


class LoadLoRAAdapterRequest(StrictModel):
    """``POST /v1/load_lora_adapter``, vLLM's shape."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(StrictModel):
    """``POST /v1/unload_lora_adapter``, vLLM's shape (``lora_int_id`` accepted, unused)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None
