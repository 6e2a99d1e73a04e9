"""What the gateway sends an upstream and reads back of usage: the request body with the
tenant's ``cache_salt``, the upstream model name, ``stream_options.include_usage`` and the
admitted ``max_tokens`` spliced in (:func:`upstream_body`); the usage of an answer
(:class:`Usage`) read from a stream's events as they are relayed, with only the usage the
client asked for passed on (:func:`_take_usage`); and the error event that ends a broken stream
(:func:`error_event`).

The attempt loop that uses them is ``gateway/relay/proxy.py``; the stream's per-chunk path
(the SSE events as they arrive) is ``gateway/relay/stream_relay.py``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.body.fields import RequestFields
from gateway.identity.cache_salts import narrowed_salt
from gateway.relay.output_tokens import OutputCounter
from portico.errors import error_body

log = logging.getLogger("portico.gateway.proxy")  # the proxy's channel, as before the split

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

DONE_EVENT = b"data: [DONE]\n\n"
_USAGE_MARKS = (b'"usage":{', b'"usage": {')
_USAGE_OPTION = b'"stream_options":{"include_usage":true}'
_CONTINUOUS_OPTION = b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}'
_LAST_USAGE = b',"usage":{'  # the engine's chunks end with their usage (compact JSON)
_LAST_USAGE_SPACED = b', "usage": {'  # json.dumps' default separators
_NULL_USAGE = b',"usage":null}'
_NO_CHOICES = (b'"choices":[]', b'"choices": []')  # a stream's final usage-only event


@dataclass(slots=True)
class Usage:
    """Token counts of one answer (zero until known).

    ``source`` says who counted: ``"upstream"`` (its usage report), or the gateway itself when
    the upstream reported none: ``"tokenizer"`` (the model's tokenizer over the output text) or
    ``"estimate"`` (the provider's documented rule, ~4 characters per token). When the gateway
    counted, ``prompt_tokens`` is 0 and the caller uses its own admission count instead.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    # of prompt_tokens, those read from the upstream's prefix cache (priced as cached input)
    cached_tokens: int = 0
    reported: bool = False
    source: str = "upstream"
    # A Responses API stream: the response object of its ``response.completed`` event (the
    # gateway stores it when the client asked to).
    response: dict[str, Any] | None = None
    # A stream with usage on every chunk: the latest event carrying it and where its usage
    # starts, parsed once by :meth:`resolve` when the stream ends (not on every chunk).
    pending: bytes = b""
    pending_at: int = -1

    def resolve(self) -> None:
        """Read the latest usage a stream carried (see ``pending``); idempotent."""
        if self.pending:
            event, self.pending = self.pending, b""
            try:
                self.take(_loads(event[event.index(b"{", self.pending_at) : -1]))
            except ValueError:
                log.warning("unreadable usage in a stream chunk: %.200r", event)

    def take(self, usage: Any) -> None:
        """Read OpenAI's usage object: chat/completions/embeddings names, the Responses
        API's (``input_tokens``/``output_tokens``), or rerank's (Cohere's and Jina's shape:
        ``total_tokens`` alone, all of them read, none generated)."""
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if prompt is None and completion is None:
                prompt = usage.get("total_tokens")
            self.prompt_tokens = int(prompt or 0)
            self.completion_tokens = int(completion or 0)
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            self.cached_tokens = int(cached or 0)
            self.reported = True
            self.source = "upstream"

    def count(self, counter: OutputCounter, completion_tokens: int) -> None:
        """Usage the gateway counted itself (the upstream reported none)."""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = completion_tokens
        self.reported = True
        self.source = counter.source


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """The SSE event that ends a stream the upstream broke, followed by ``[DONE]``."""
    payload = _dumps(error_body(message, "upstream_error", None, code))
    return b"data: " + payload + b"\n\n" + DONE_EVENT


def engine_salt(fields: RequestFields, tenant_salt: str) -> str:
    """The ``cache_salt`` the engine gets for a request of the tenant salted ``tenant_salt``:
    the tenant's, narrowed by the client's own (:func:`narrowed_salt`, a SHA-256 computed once
    per request and kept on ``fields``, so the router and the body agree without hashing
    twice)."""
    if fields.cache_salt is None:
        return tenant_salt
    memo = fields.narrowed_salt
    if memo is None or memo[0] != tenant_salt:
        memo = (tenant_salt, narrowed_salt(tenant_salt, fields.cache_salt))
        fields.narrowed_salt = memo
    return memo[1]


def upstream_body(
    raw: bytes,
    fields: RequestFields,
    model: str,
    cache_salt: str | None,
    max_tokens: int | None = None,
    local_engine: bool = False,
) -> bytes:
    """The body sent to the engine: the client's bytes with the tenant's ``cache_salt``, the
    upstream model name, ``stream_options.include_usage`` and (when the client set none) the
    ``max_tokens`` admission reserved (or a lower one, the tenant's token budget's
    remainder) spliced in. The common case (no alias, no client
    ``cache_salt``/``stream_options``) edits bytes without re-serializing.

    ``local_engine``: every chunk of a stream carries the usage so far (vLLM's
    ``continuous_usage_stats``), so a stream cut short is charged what it generated (the relay
    gives the client only the usage it asked for, :func:`_take_usage`)."""
    body = fields.body
    # A Responses stream reports usage in its last event; it has no stream_options to set.
    usage_option = fields.stream and fields.kind != "responses"
    if (
        model == fields.model
        and "cache_salt" not in body
        and "stream_options" not in body
        and not fields.edited
        and (max_tokens is None or fields.max_tokens is None)  # no client cap to lower
    ):
        extra = []
        if max_tokens is not None:
            extra.append(b'"%s":%d' % (fields.max_tokens_field.encode(), max_tokens))
        if cache_salt is not None:
            extra.append(b'"cache_salt":' + _dumps(cache_salt))
        if usage_option:
            extra.append(_CONTINUOUS_OPTION if local_engine else _USAGE_OPTION)
        if not extra:
            return raw
        end = raw.rstrip().rfind(b"}")
        return raw[:end] + b"," + b",".join(extra) + b"}"
    edited = dict(body)
    edited["model"] = model
    edited.pop("cache_salt", None)  # a client's salt only narrows its tenant's, never replaces
    if cache_salt is not None:
        edited["cache_salt"] = engine_salt(fields, cache_salt)
    if max_tokens is not None:
        edited.pop("max_completion_tokens", None)  # it would win over max_tokens
        edited[fields.max_tokens_field] = max_tokens
    if usage_option:
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        if local_engine:
            options["continuous_usage_stats"] = True
        elif not fields.wants_usage:  # vLLM: no usage on each chunk unless usage was asked for
            options.pop("continuous_usage_stats", None)
        edited["stream_options"] = options
    return _dumps(edited)


@dataclass(frozen=True, slots=True)
class UsageView:
    """What the client of a stream sees of usage: the final usage event (``include_usage``)
    and usage on every chunk (``continuous_usage_stats``); ``continuous`` says the upstream
    was asked for usage on every chunk, which the relay then reads and hides as asked."""

    final: bool = False
    every_chunk: bool = False
    continuous: bool = False


def usage_view(fields: RequestFields, continuous: bool) -> UsageView:
    """The client's view of a stream's usage, from its ``stream_options``."""
    options = fields.body.get("stream_options")
    every = isinstance(options, dict) and bool(options.get("continuous_usage_stats"))
    # a Responses stream is not asked for it: its usage is in its last event only
    continuous = continuous and fields.kind != "responses"
    return UsageView(fields.wants_usage, fields.wants_usage and every, continuous)


def _take_usage(block: bytes, usage: Usage, view: UsageView | bool) -> bytes:
    """Read the usage in ``block`` (one or more SSE events); pass the client only the usage
    ``view`` says it asked for (a bool: whether the final usage event is kept)."""
    if isinstance(view, UsageView) and view.continuous:
        return _take_continuous_usage(block, usage, view)
    if not any(mark in block for mark in _USAGE_MARKS):
        return block
    if isinstance(view, bool):
        view = UsageView(final=view)
    keep_usage = view.final
    kept = []
    for event in block.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"event: response.completed\n"):
            _take_response_completed(event, usage)
        if event.startswith(b"data: {") and any(mark in event for mark in _USAGE_MARKS):
            try:
                data = _loads(event[6:])
            except ValueError:
                data = None
            if isinstance(data, dict):
                usage.take(data.get("usage"))
                if not keep_usage and not data.get("choices"):
                    continue  # the usage-only event the client did not ask for
        kept.append(event + b"\n\n")
    return b"".join(kept)


def _take_continuous_usage(block: bytes, usage: Usage, view: UsageView) -> bytes:
    """A local engine's stream with usage on every chunk: the usage object ends each event.
    The latest one is kept for :meth:`Usage.resolve` (one parse per stream, when it ends),
    and it is replaced by ``null`` on the chunks of a client that did not ask for it, exactly
    what the engine would have sent that client.

    The events are ``block.split(b"\\n\\n")``'s (empty ones dropped), read in one loop and
    joined back with their blank lines once (no call, and no copy with its blank line, per
    event)."""
    kept = []
    last, last_at = b"", -1  # the latest event with usage, and where its usage starts
    for event in block.split(b"\n\n"):
        if not event:
            continue
        at = event.rfind(_LAST_USAGE)
        if at < 0:
            at = event.rfind(_LAST_USAGE_SPACED)
        if at < 0 or event[-1] != 0x7D or not event.startswith(b"data: {"):
            kept.append(event)  # no usage at its end: as it came
            continue
        last, last_at = event, at
        if view.every_chunk:
            kept.append(event)
        elif event.endswith(_NO_CHOICES, 0, at):  # the final usage-only event
            if view.final:
                kept.append(event)
        else:
            kept.append(event[:at] + _NULL_USAGE)
    if last_at >= 0:
        usage.pending, usage.pending_at = last, last_at
    if not kept:
        return b""
    kept.append(b"")  # the last event's blank line
    return b"\n\n".join(kept)


def _take_response_completed(event: bytes, usage: Usage) -> None:
    """The usage and the response object of a Responses stream's last event."""
    data_at = event.find(b"\ndata: ")
    try:
        data = _loads(event[data_at + 7 :]) if data_at >= 0 else None
    except ValueError:
        data = None
    response = data.get("response") if isinstance(data, dict) else None
    if isinstance(response, dict):
        usage.take(response.get("usage"))
        usage.response = response
