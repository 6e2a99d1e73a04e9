"""The request fields that ask for structured output, and the one constraint they become.

Three spellings reach the same :class:`~engine.sampling_params.StructuredOutputsParams`:

* OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (what ``client.chat.completions.parse(response_format=Model)`` sends);
* vLLM's current ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object", "disable_any_whitespace", ...}``;
* vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (+ ``guided_decoding_backend``, ``guided_whitespace_pattern``).

At most one constraint per request; a second is a 400, as is a backend other than xgrammar.
Each error names the parameter the user wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import ParameterError, StructuredOutputsParams
from portico.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.server.protocol import SamplingFields

# guided_decoding_backend values that mean "the server's grammar library" (xgrammar here).
ACCEPTED_BACKENDS = frozenset({"auto", "xgrammar"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # "schema" shadows a BaseModel attribute in pydantic; keep the JSON name via an alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` request object (the knobs that change nothing here,
    ``disable_fallback`` and ``whitespace_pattern``, are accepted as vLLM's xgrammar path
    accepts them)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None


def structured_outputs_for(req: SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the parameter it came from, or None for free text."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        found.append(_from_response_format(fmt))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs, req))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            ws = req.guided_whitespace_pattern
            found.append((_build(name, **{key: value, "whitespace_pattern": ws}), name))
    backend = req.guided_decoding_backend
    if backend is not None and backend not in ACCEPTED_BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not available: this server uses xgrammar "
            f"(accepted: {', '.join(sorted(ACCEPTED_BACKENDS))}).",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        names = ", ".join(param.split(".")[0] for _, param in found)
        raise InvalidRequestError(
            f"Only one structured-output constraint may be given per request; got {names}.",
            param=found[1][1].split(".")[0],
        )
    return found[0] if found else None


def _from_response_format(fmt: ResponseFormat) -> tuple[StructuredOutputsParams, str]:
    if fmt.type == "json_object":
        return _build("response_format", json_object=True), "response_format"
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format of type 'json_schema' needs a 'json_schema' object.",
            param="response_format.json_schema",
        )
    schema = fmt.json_schema.json_schema
    param = "response_format.json_schema.schema"
    if schema is None:  # OpenAI allows a name without a schema: any JSON object
        return _build(param, json_object=True), param
    return _build(param, json=schema), param


def _from_structured_outputs(
    field: StructuredOutputsField, req: SamplingFields
) -> tuple[StructuredOutputsParams, str]:
    spec = _build(
        "structured_outputs",
        json=field.json_,
        regex=field.regex,
        choice=field.choice,
        grammar=field.grammar,
        json_object=bool(field.json_object),
        disable_any_whitespace=field.disable_any_whitespace,
        whitespace_pattern=field.whitespace_pattern,
    )
    return spec, f"structured_outputs.{spec.kind}"


def _build(param: str, **fields: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ParameterError as exc:
        raise InvalidRequestError(
            str(exc).replace("structured_outputs", param, 1), param=param
        ) from None
