"""The few request fields the gateway reads, picked from the JSON body in one pass.

The body is parsed once (``json.loads``), the fields the gateway needs are checked for type,
and the parsed dict is kept so the proxy can edit it if it must. No pydantic model of the
whole body: the engine validates the rest and answers in the same error shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.body.body_checks import (
    check_messages,
    check_parts,
    check_prompt_items,
    check_sampling,
)
from portico.contract import MAX_CACHE_SALT_CHARS
from portico.errors import InvalidRequestError, type_error

try:  # orjson parses 2-3x faster; optional
    import orjson

    _loads = orjson.loads
    _DecodeError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads  # type: ignore[assignment]
    _DecodeError = (ValueError,)


@dataclass(slots=True)
class RequestFields:
    """What routing, admission and the proxy need to know about one request."""

    # "chat" | "completion" | "embedding" | "score" | "rerank" | "responses" | "tokenize" |
    # "detokenize"
    kind: str
    model: str
    stream: bool
    max_tokens: int | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[Any] | None
    num_tools: int
    wants_usage: bool  # stream_options.include_usage asked by the client
    body: dict[str, Any]
    # completions the request asks for per max_tokens: n (or best_of, which generates that
    # many and returns n) times the number of prompts; admission reserves that many
    num_outputs: int = 1
    edited: bool = False  # the gateway changed ``body``: the proxy sends it re-serialized
    # The client's own ``cache_salt`` (checked: a string of 1..1024 characters). It only
    # narrows the tenant's salt (gateway/identity/cache_salts.py ``narrowed_salt``); the engine
    # never receives it raw.
    cache_salt: str | None = None
    # (tenant salt, the engine's salt for it narrowed by ``cache_salt``): the narrowing is a
    # SHA-256, computed once per request and reused by the router and the engine body
    # (gateway/relay/usage_relay.py ``engine_salt``).
    narrowed_salt: tuple[str, str] | None = None
    # (plan salt, number of characters): the request starts with one of its plan's shared
    # prefixes (:func:`match_shared_prefix`); set by the request path, told to local engines
    # in a header (gateway/relay/proxy.py SHARED_PREFIX_HEADER)
    shared_prefix: tuple[str, int] | None = None
    # A chat prompt's token ids as admission's counter rendered and encoded them, with the
    # tokenizer and the messages list they came from: the prefix-aware router reuses them
    # rather than rendering the prompt again (gateway/fleet/prefix_index.py route_token_ids).
    chat_prompt_ids: tuple[Any, list[dict[str, Any]], list[int]] | None = None
    # A text completion prompt's token ids as admission encoded them, with the tokenizer and
    # the prompt: carried to a local engine (gateway/relay/carried_prompt.py)
    text_prompt_ids: tuple[Any, str, list[int]] | None = None
    # whether the engine body the proxy built last carries those ids (LocalUpstream.payload):
    # the hop header then says so
    ids_carried: bool = False

    @property
    def max_tokens_name(self) -> str:
        """The field the client capped the output with (for a 400 naming it)."""
        if self.kind == "responses":
            return "max_output_tokens"
        return "max_completion_tokens" if "max_completion_tokens" in self.body else "max_tokens"

    @property
    def max_tokens_field(self) -> str:
        """The body field that caps the output (the Responses API names it differently)."""
        return "max_output_tokens" if self.kind == "responses" else "max_tokens"


GENERATING_KINDS = frozenset({"chat", "completion", "responses"})
# Kinds that read a prompt and generate nothing: admission reserves the prompt alone.
POOLING_KINDS = frozenset({"embedding", "score", "rerank"})


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        texts = (p.get("text") for p in content if isinstance(p, dict))
        return "".join(t for t in texts if isinstance(t, str))
    return ""


def prompt_text(fields: RequestFields) -> str:
    """All prompt text, concatenated (for complexity scoring and remote token estimates)."""
    if fields.messages is not None:
        return "\n".join(_text_of(m.get("content")) for m in fields.messages)
    if isinstance(fields.prompt, str):
        return fields.prompt
    if isinstance(fields.prompt, list):
        return "\n".join(p for p in fields.prompt if isinstance(p, str))
    return ""


def prefix_text(fields: RequestFields, num_chars: int) -> str:
    """The start of the system prompt (or of the first message / the prompt): the affinity key."""
    if fields.messages:
        first = next((m for m in fields.messages if m.get("role") == "system"), fields.messages[0])
        return _text_of(first.get("content"))[:num_chars]
    if isinstance(fields.prompt, str):
        return fields.prompt[:num_chars]
    return ""


def match_shared_prefix(fields: RequestFields, prefixes: tuple[str, ...]) -> int:
    """The length in characters of the longest of ``prefixes`` the request starts with: its
    first message's text (chat) or its prompt (completions), 0 when none. Only these two
    shapes are matched: the engine finds the prefix's tokens in the same place."""
    if not prefixes:
        return 0
    text = None
    if fields.kind == "chat" and fields.messages:
        text = fields.messages[0].get("content")
    elif fields.kind == "completion":
        text = fields.prompt
    if not isinstance(text, str):
        return 0
    return max((len(p) for p in prefixes if text.startswith(p)), default=0)


def _bad(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = _loads(raw)
    except _DecodeError:
        raise _bad("We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    return body


def client_cache_salt(body: dict[str, Any]) -> str | None:
    """The client's ``cache_salt``: absent or null is None; anything but a string of
    1..1024 characters is a 400 naming the field (the engine would refuse it too, but the
    gateway replaces the salt, so it must check the client's before it does)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise _bad(
            "Invalid value for 'cache_salt': must be a string of 1 to "
            f"{MAX_CACHE_SALT_CHARS} characters.",
            "cache_salt",
        )
    return salt


def _missing(param: str) -> InvalidRequestError:
    return _bad(f"Missing required parameter: '{param}'.", param)


def _required(body: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    """``body[name]``: absent or null is "missing", another type is "invalid type", an empty
    string or array is "invalid value"; each a 400 naming the field."""
    value = body.get(name)
    if value is None:
        raise _missing(name)
    if not isinstance(value, types) or isinstance(value, bool):
        raise type_error(name, value)
    if not value:
        raise _bad(f"Invalid value for '{name}': must not be empty.", name)
    return value


def parse_fields(raw: bytes, kind: str) -> RequestFields:
    """Parse the body and check the fields the gateway uses, and the sampling fields' types
    and ranges (so a malformed request is a 400 before any quota is looked at); 400 in
    OpenAI's shape otherwise."""
    body = parse_body(raw)
    model = _required(body, "model", str)
    fields = _parse_kind(kind, model, body)
    if kind in GENERATING_KINDS:
        check_sampling(body)
    if "cache_salt" in body:
        fields.cache_salt = client_cache_salt(body)
    return fields


def _parse_kind(kind: str, model: str, body: dict[str, Any]) -> RequestFields:
    if kind not in GENERATING_KINDS:
        return _non_generating_fields(kind, model, body)
    if kind == "responses":
        return responses_fields(model, body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("Invalid value for 'stream': must be a boolean.", "stream")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _positive_int(body, name)
    messages = prompt = None
    if kind == "chat":
        messages = check_messages(_required(body, "messages", list))
    else:
        prompt = _required(body, "prompt", (str, list))
        check_prompt_items(prompt, "prompt")
    tools = body.get("tools")
    if tools is None:
        tools = body.get("functions") or []
    if not isinstance(tools, list):
        raise _bad("Invalid value for 'tools': must be an array.", "tools")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("Invalid value for 'stream_options': must be an object.", "stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    num_outputs = max(_count(body, "n"), _count(body, "best_of"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_outputs *= len(prompt)  # a batch of prompts: each gets its own completions
    return RequestFields(
        kind,
        model,
        stream,
        max_tokens,
        messages,
        prompt,
        len(tools),
        wants_usage,
        body,
        num_outputs,
    )


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    """An optional positive integer field (absent or null: None), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise type_error(name, value, "an integer")
    if value < 1:
        raise _bad(f"Invalid value for '{name}': must be a positive integer.", name)
    return value


def _count(body: dict[str, Any], name: str) -> int:
    """A positive integer output multiplier (``n``, ``best_of``); absent or null: 1."""
    value = _positive_int(body, name)
    return 1 if value is None else value


def _non_generating_fields(kind: str, model: str, body: dict[str, Any]) -> RequestFields:
    """Embeddings, score and rerank (their texts are the prompt; nothing is generated:
    ``max_tokens`` 0) and tokenize/detokenize (nothing counted)."""
    prompt: str | list[Any] | None = None
    messages = None
    if kind == "embedding":
        prompt = _required(body, "input", (str, list))
        check_prompt_items(prompt, "input")
    elif kind == "score":
        prompt = _score_prompt(body)
    elif kind == "rerank":
        prompt = _rerank_prompt(body)
    return RequestFields(kind, model, False, 0, messages, prompt, 0, False, body, 1)


def _texts(body: dict[str, Any], name: str) -> list[str]:
    """A score side (``text_1``, ``text_2``): a non-empty string or list of them."""
    value = body.get(name)
    if value is None:
        raise _missing(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise _bad(f"Invalid value for '{name}': must be a string or a non-empty array.", name)
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            param = name if isinstance(value, str) else f"{name}[{i}]"
            raise _bad(f"Invalid value for '{param}': must be a non-empty string.", param)
    return texts


def _score_prompt(body: dict[str, Any]) -> list[str]:
    """The texts of ``/v1/score`` as the engine reads them at most: each pair's two texts
    (a cross-encoder reads them as one sequence; an embedding model reads each text once,
    fewer), so admission reserves no less than the engine's count."""
    texts_1, texts_2 = _texts(body, "text_1"), _texts(body, "text_2")
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise _bad(
            "text_1 and text_2 must pair 1:1, 1:N or N:N; got "
            f"{len(texts_1)} and {len(texts_2)} texts.",
            "text_2",
        )
    return [t for i, text in enumerate(texts_2) for t in (texts_1[i % len(texts_1)], text)]


def _rerank_prompt(body: dict[str, Any]) -> list[str]:
    """The texts of a rerank request (the query beside each document), checked as far as
    admission depends on them: ``query``, ``documents`` and ``top_n``."""
    query = _required(body, "query", str)
    documents = _required(body, "documents", list)
    texts = []
    for i, doc in enumerate(documents):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str) or not text:
            raise _bad(
                f"Invalid value for 'documents[{i}]': must be a non-empty string or an object "
                "with a non-empty 'text'.",
                f"documents[{i}]",
            )
        texts += [query, text]
    top_n = body.get("top_n")
    if top_n is not None and (
        not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= len(documents)
    ):
        raise _bad(
            f"Invalid value for 'top_n': must be an integer from 0 to the number of documents "
            f"({len(documents)}).",
            "top_n",
        )
    return texts


def responses_fields(model: str, body: dict[str, Any]) -> RequestFields:
    """A Responses API request: ``input`` (string or items) and ``instructions`` read as chat
    turns for counting and routing; ``max_output_tokens`` is the cap."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("Invalid value for 'stream': must be a boolean.", "stream")
    max_tokens = _positive_int(body, "max_output_tokens")
    items = input_items(body.get("input"))
    messages = turns_of(items)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise _bad("Invalid value for 'tools': must be an array.", "tools")
    return RequestFields("responses", model, stream, max_tokens, messages, None, len(tools),
                         False, body, 1)  # fmt: skip


def input_items(value: Any) -> list[dict[str, Any]]:
    """A Responses ``input`` as a list of items (a string is one user message)."""
    if value is None:
        raise _missing("input")
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        if isinstance(value, str):  # the empty string
            raise _bad("Invalid value for 'input': must not be empty.", "input")
        raise type_error("input", value, "a string or an array of input items")
    if not value:
        raise _bad("Invalid value for 'input': must not be empty.", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise type_error(f"input[{i}]", item, "an input item object")
        content = item.get("content")
        if isinstance(content, list):
            check_parts(content, f"input[{i}].content")
        elif content is not None and not isinstance(content, str):
            raise type_error(f"input[{i}].content", content, "a string or an array of parts")
    return value


def turns_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-like turns of Responses input items: what admission counts and routing scores
    (the engine renders the exact prompt)."""
    turns = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role") if item.get("role") in ("system", "assistant") else "user"
            turns.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            text = f"{item.get('name', '')}({item.get('arguments', '')})"
            turns.append({"role": "assistant", "content": text})
        elif kind == "function_call_output":
            turns.append({"role": "user", "content": _text_of(item.get("output"))})
    return turns or [{"role": "user", "content": ""}]
