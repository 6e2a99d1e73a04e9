"""The OpenAI request bodies the engine server accepts, validated once at the edge: the shared
part. Each endpoint's bodies live beside it (:mod:`engine.server.protocol_chat`,
:mod:`engine.server.protocol_completions`, :mod:`engine.server.protocol_responses`); this module
holds what they share: the strict base model, the sampling fields of chat and completions, the
harmless-value tables' helper and vLLM's common unsupported fields, and the parser.

Every body is a strict pydantic model with ``extra="forbid"``: an unknown field is a 400 that
names it, as OpenAI's API answers. Fields that OpenAI defines but this engine cannot honour yet
(audio, the legacy ``functions``, ...) are listed in each endpoint's ``*_UNSUPPORTED`` table with
the values that are harmless (``None``, ``"none"``, ``[]``): any other value is a 400 naming the
field, never a silent ignore.

:func:`parse_body` is the one entry: raw bytes in, a typed request out, or an
:class:`~portico.errors.InvalidRequestError` whose message names the first bad parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from engine.server.structured_fields import ResponseFormat, StructuredOutputsField
from portico.contract import MAX_CACHE_SALT_CHARS
from portico.errors import EXPECTED_TYPES, InvalidRequestError, type_error

MAX_N = 16
MAX_STOP_SEQUENCES = 32
MAX_LOGPROBS = 20

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class StrictModel(BaseModel):
    """Base of every request body: unknown fields and loose type coercions are rejected."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    """``stream_options``: OpenAI's ``include_usage`` (a final chunk carrying usage) and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``, every chunk carries the usage so far:
    benchmarks such as guidellm count tokens from it)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    # the gateway's carried prompt (portico/contract.py PROMPT_IDS_FIELD): read only with its
    # header, so any value a client forges is ignored, never rejected
    portico_prompt_token_ids: Any = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Probability | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
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


def none_or(*allowed: Any) -> Callable[[Any], bool]:
    """A harmless-value predicate: ``None`` or one of ``allowed`` asks for nothing unsupported."""
    return lambda value: value is None or value in allowed


# Fields vLLM's OpenAI server accepts that this engine does not implement. A client that sends
# the value meaning "off" (vLLM's default) is served; any other value is a 400 that says the
# field is not supported, so a vLLM client learns why instead of reading "unrecognized".
VLLM_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": none_or(False),
    "length_penalty": none_or(1, 1.0),
    "spaces_between_special_tokens": none_or(True),
    "allowed_token_ids": none_or(),
    "bad_words": none_or([]),
    "logits_processors": none_or(),
    "return_tokens_as_token_ids": none_or(False),
    "return_token_ids": none_or(False),
    "request_id": none_or(),
    "kv_transfer_params": none_or(),
    "vllm_xargs": none_or(),
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


_UNION_MARKERS = frozenset(
    {"str", "list[str]", "list[int]", "none", "int", "float", "TextPart", "ImagePart"}
)


def _param_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_MARKERS:
            continue  # pydantic's union-branch markers, not part of the parameter's path
        elif "[" in part or part.startswith("function-"):
            continue
        else:
            path += f".{part}" if path else part
    return path


# pydantic's type errors -> what the parameter should have been, in JSON's words
_EXPECTED_BY_ERROR = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
MISSING_FIELD = "missing_field"  # a validator's own "missing": ctx["field"] names the field


def missing_field(name: str) -> PydanticCustomError:
    """Raise from a model validator when ``name`` is required in this case (a user message's
    ``content``): reported as ``Missing required parameter: '<path>.<name>'``."""
    return PydanticCustomError(MISSING_FIELD, "{field} is required", {"field": name})


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """One short sentence for the most useful error of pydantic's list, and the parameter."""
    errors = exc.errors(include_url=False)
    # A union reports one error per branch; the one deepest in the input is the most telling.
    first = max(errors, key=lambda e: len(e["loc"])) if errors else None
    if first is None:
        return "Invalid request body.", None
    param = _param_path(tuple(first["loc"])) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == MISSING_FIELD:
        field = str((first.get("ctx") or {}).get("field", ""))
        param = f"{param}.{field}" if param else field
        kind = "missing"
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind in _EXPECTED_BY_ERROR and param:
        # every branch of a union that refused the value's type says what it takes
        kinds = [
            e["type"] for e in errors if e["type"] in _EXPECTED_BY_ERROR
            and _param_path(tuple(e["loc"])) == param
        ]  # fmt: skip
        expected = EXPECTED_TYPES.get(param) or " or ".join(
            dict.fromkeys(_EXPECTED_BY_ERROR[k] for k in kinds)
        )
        return type_error(param, first.get("input"), expected).message, param
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
