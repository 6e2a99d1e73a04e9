"""Forwarding to a pool of OpenAI-compatible servers: replica choice, retries before the first
byte, SSE relay. The pool is a local engine pool, or (``gateway/dataplane/openai_remote.py``) the
endpoints of a remote OpenAI-compatible provider reached over the same lean transport.

``LocalUpstream.exchange`` runs the attempt loop: pick a replica (prefix affinity, least
outstanding), send, and retry on connect errors, broken answers and the policy's statuses
(502/503/504, engine 429) — with full-jitter backoff, a maximum number of attempts and an
overall deadline — but only until the first byte is ready for the client. For a stream the
first SSE event is read inside the loop, so an engine that dies before answering is retried
like any other failure. Once an :class:`Exchange` is returned nothing is retried; a stream
broken later ends with an error event and ``data: [DONE]``.

Usage for settlement: the engine is always asked for ``stream_options.include_usage``; the
usage event is read here and dropped from the relay when the client did not ask for it. An
upstream that reports no usage (some remote providers' streams) is counted by the upstream's
:class:`~gateway.dataplane.output_tokens.OutputCounter`, when it has one, and ``Usage.source``
says how.

Every request to a local engine names the caller's tenant and plan share in ``x-portico-*``
headers (gateway/dataplane/engine_hop.py); upstream headers are built from scratch, so a
client's own never travel.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from starlette.responses import Response

from gateway.dataplane.engine_hop import engine_hop_headers
from gateway.dataplane.fields import RequestFields
from gateway.dataplane.output_tokens import OutputCounter
from gateway.dataplane.pool import Pool, Replica
from gateway.dataplane.prefix_index import RouteTokens, route_token_ids
from gateway.dataplane.retry import RetryPolicy
from gateway.dataplane.transport import read_body
from gateway.identity.cache_salts import narrowed_salt
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from portico.errors import ServiceUnavailableError, UpstreamError, error_body

log = logging.getLogger("portico.gateway.proxy")

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
# the request starts with a shared prefix of its plan (gateway/identity/cache_salts.py):
# "<characters>;<salt>", read by engine/server/shared_prefix.py
SHARED_PREFIX_HEADER = "x-portico-cache-shared-prefix"
_NULL_USAGE_END = b',"usage":null}\n\n'


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
        """Read OpenAI's usage object: chat/completions/embeddings names, or the Responses
        API's (``input_tokens``/``output_tokens``)."""
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
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


@dataclass(eq=False)
class Exchange:
    """An upstream answer whose first byte is ready: relay ``body`` or ``first`` + ``rest``.

    ``upstream_s`` is the time spent waiting on upstreams so far (for the overhead header);
    ``close`` must be awaited once the relay is over (it frees the replica).
    """

    status: int
    content_type: str
    body: bytes | None = None
    first: bytes | None = None
    rest: AsyncIterator[bytes] | None = None
    usage: Usage = field(default_factory=Usage)
    upstream_s: float = 0.0
    attempts: int = 1
    close: Callable[[], Awaitable[None]] | None = None


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """The SSE event that ends a stream the upstream broke, followed by ``[DONE]``."""
    payload = _dumps(error_body(message, "upstream_error", None, code))
    return b"data: " + payload + b"\n\n" + DONE_EVENT


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
        edited["cache_salt"] = narrowed_salt(cache_salt, fields.cache_salt)
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
    what the engine would have sent that client."""
    if block.find(b"\n\n") == len(block) - 2:  # one event per read: the common case
        return _continuous_event(block[:-2], usage, view)
    return b"".join(_continuous_event(e, usage, view) for e in block.split(b"\n\n") if e)


def _continuous_event(event: bytes, usage: Usage, view: UsageView) -> bytes:
    """One event (without its blank line) as the client gets it, blank line included."""
    at = event.rfind(_LAST_USAGE)
    if at < 0:
        at = event.rfind(_LAST_USAGE_SPACED)
    if at < 0 or event[-1:] != b"}" or not event.startswith(b"data: {"):
        return event + b"\n\n"
    usage.pending, usage.pending_at = event, at
    if view.every_chunk:
        return event + b"\n\n"
    head = event[:at]
    if head.endswith((b'"choices":[]', b'"choices": []')):  # the final usage-only event
        return event + b"\n\n" if view.final else b""
    return head + _NULL_USAGE_END


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


async def sse_blocks(resp: httpx.Response) -> AsyncGenerator[bytes, None]:
    """Complete SSE events as they arrive (each yield holds one or more whole events)."""
    buffer = b""
    async for data in resp.aiter_raw():
        buffer += data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            continue
        yield buffer[: cut + 2]
        buffer = buffer[cut + 2 :]
    if buffer.strip():
        yield buffer + b"\n\n"


class Upstream(Protocol):
    """Where the gateway forwards a routed request: a local engine pool (:class:`LocalUpstream`),
    an OpenAI-compatible remote over the same transport
    (:class:`~gateway.dataplane.openai_remote.OpenAIRemoteUpstream`) or a provider that needs
    translation (:class:`~gateway.dataplane.remote.RemoteUpstream`, litellm). All retry only
    before the first byte and answer with an :class:`Exchange` the gateway relays as is.

    ``tenant_keys``: the upstream may send a tenant's own provider key (``credential``) instead
    of its configured one.
    """

    name: str
    tenant_keys: bool

    def payload(
        self,
        raw: bytes,
        fields: RequestFields,
        model: str,
        cache_salt: str | None,
        max_tokens: int | None,
    ) -> bytes: ...

    async def exchange(
        self,
        path: str,
        payload: bytes,
        fields: RequestFields,
        request_id: str,
        prefix_key: bytes | None,
        avoid: tuple[Replica, ...] = (),  # replicas to pick last (e.g. lacking an adapter)
        credential: str | None = None,
        principal: Principal | None = None,  # the caller: local engines are told its tenant
    ) -> Exchange: ...


class AttemptTracer(Protocol):
    """Wraps each upstream attempt in a span and adds ``traceparent`` to its headers
    (gateway/tracing.py); None when tracing is off."""

    async def attempt(
        self,
        send: Callable[
            [Replica, httpx.URL, bytes, dict[str, str], RequestFields], Awaitable[Exchange]
        ],
        replica: Replica,
        url: httpx.URL,
        payload: bytes,
        headers: dict[str, str],
        fields: RequestFields,
    ) -> Exchange: ...


class LocalUpstream:
    """A pool of engine replicas behind one model name; one shared HTTP client per replica.

    Subclasses for other OpenAI-compatible servers change where a request goes
    (:meth:`request_url`), what it carries (:meth:`request_headers`, :meth:`payload`) and who
    counts usage an upstream did not report (``counter``); the attempt loop is this one.
    """

    tenant_keys = False
    tracer: AttemptTracer | None = None  # set by the gateway when tracing is on
    # One of our engines: streams carry the usage so far on every chunk (the engine's
    # continuous_usage_stats), so a stream the client leaves midway is still charged what the
    # gateway saw generated; and a request's shared prefix is declared in a header.
    local_engine = True

    def __init__(
        self,
        pool: Pool,
        policy: RetryPolicy,
        metrics: GatewayMetrics,
        *,
        counter: OutputCounter | None = None,
    ) -> None:
        self.pool = pool
        self.name = pool.name
        self.policy = policy
        self.metrics = metrics
        self.counter = counter
        # the served model's tokenizer, for the pool's prefix_aware policy (set at start-up)
        self.route_tokenizer: Any | None = None

    def payload(
        self,
        raw: bytes,
        fields: RequestFields,
        model: str,
        cache_salt: str | None,
        max_tokens: int | None,
    ) -> bytes:
        """The body the engine gets (:func:`upstream_body`)."""
        return upstream_body(raw, fields, model, cache_salt, max_tokens, self.local_engine)

    def _route_tokens(
        self, fields: RequestFields, principal: Principal | None
    ) -> RouteTokens | None:
        """The request's tokens and engine salt for a prefix_aware pool (else None): the salt
        is the one :func:`upstream_body` sends."""
        if self.route_tokenizer is None or self.pool.replica_policy != "prefix_aware":
            return None
        try:
            token_ids = route_token_ids(self.route_tokenizer, fields)
        except Exception:  # a template refusing these messages: the engine will say why
            return None
        if token_ids is None:
            return None
        tenant_salt = principal.cache_salt if principal is not None else None
        salt = narrowed_salt(tenant_salt, fields.cache_salt) if tenant_salt is not None else None
        return RouteTokens(token_ids, salt)

    def request_url(self, path: str) -> httpx.URL:
        return _engine_url(path)

    def request_headers(
        self, request_id: str, credential: str | None, principal: Principal | None = None
    ) -> dict[str, str]:
        """The whole header set of an engine request (nothing of the client's is copied)."""
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if principal is not None:
            headers.update(engine_hop_headers(principal))
        return headers

    async def exchange(
        self,
        path: str,
        payload: bytes,
        fields: RequestFields,
        request_id: str,
        prefix_key: bytes | None,
        avoid: tuple[Replica, ...] = (),
        credential: str | None = None,
        principal: Principal | None = None,
    ) -> Exchange:
        """Send until an answer's first byte is ready or the policy gives up; replicas in
        ``avoid`` (e.g. not holding the request's adapter) are picked only when no other can.
        ``principal``: the caller, named to the engine (:func:`engine_hop_headers`)."""
        policy = self.policy
        deadline = time.monotonic() + policy.deadline_s
        headers = self.request_headers(request_id, credential, principal)
        if self.local_engine and fields.shared_prefix is not None:
            salt, num_chars = fields.shared_prefix
            headers[SHARED_PREFIX_HEADER] = f"{num_chars};{salt}"
        url = self.request_url(path)
        tokens = self._route_tokens(fields, principal)
        tried: tuple[Replica, ...] = ()
        waited = 0.0
        attempt = 0
        last_failure = "no healthy replica"
        last_answer: Exchange | None = None
        while True:
            attempt += 1
            replica = (
                (avoid and self.pool.pick(prefix_key, tried + avoid, tokens))
                or self.pool.pick(prefix_key, tried, tokens)
                or self.pool.pick(prefix_key, (), tokens)
            )
            if replica is not None:
                started = time.monotonic()
                replica.outstanding += 1
                try:
                    if self.tracer is None:
                        result = await self._attempt(replica, url, payload, headers, fields)
                    else:
                        result = await self.tracer.attempt(
                            self._attempt, replica, url, payload, headers, fields
                        )
                except (httpx.TransportError, _BrokenAnswer) as exc:
                    self.pool.record_failure(replica)
                    last_failure = f"{type(exc).__name__} from replica {replica.name}"
                    reason = "connect" if isinstance(exc, httpx.ConnectError) else "broken"
                else:
                    result.upstream_s = waited + time.monotonic() - started
                    result.attempts = attempt
                    if not policy.retries_status(result.status):
                        self.pool.record_success(replica)
                        return result
                    if result.status != 429:  # an engine that is busy is not failing
                        self.pool.record_failure(replica)
                    reason = str(result.status)
                    last_failure = f"status {result.status} from replica {replica.name}"
                    last_answer = result
                waited += time.monotonic() - started
                tried += (replica,)
            else:
                reason = "no_replica"
            delay = policy.backoff(attempt)
            if attempt >= policy.max_attempts or time.monotonic() + delay > deadline:
                break
            self.metrics.retries.labels(self.pool.name, reason).inc()
            log.debug("request %s: retry %d after %s", request_id, attempt, last_failure)
            await asyncio.sleep(delay)
        if last_answer is not None:
            return last_answer  # the upstream's own error answer, passed through
        if reason == "no_replica":
            raise ServiceUnavailableError(
                f"No healthy replica of '{self.pool.name}' is available; try again shortly.",
                code="no_healthy_replica",
                headers={"retry-after": "1"},
            )
        raise UpstreamError(
            f"The model '{self.pool.name}' failed to answer after {attempt} attempt(s).",
            code="upstream_unavailable",
        )

    async def _attempt(
        self,
        replica: Replica,
        url: httpx.URL,
        payload: bytes,
        headers: dict[str, str],
        fields: RequestFields,
    ) -> Exchange:
        # The replica's outstanding count was raised by the caller; every path below that does
        # not hand the open stream to ``close`` lowers it again.
        try:
            return await self._attempt_open(replica, url, payload, headers, fields)
        except BaseException:
            replica.outstanding -= 1
            raise

    async def _attempt_open(
        self,
        replica: Replica,
        url: httpx.URL,
        payload: bytes,
        headers: dict[str, str],
        fields: RequestFields,
    ) -> Exchange:
        if replica.transport is not None:
            request = httpx.Request(
                "POST",
                url,
                headers=headers,
                content=payload,
                extensions={"timeout": replica.timeouts},
            )
            resp = await replica.transport.handle_async_request(request)
        else:
            client = replica.client
            resp = await client.send(
                client.build_request("POST", url, content=payload, headers=headers), stream=True
            )
        content_type = resp.headers.get("content-type", "application/json")
        if not fields.stream or resp.status_code != 200:
            try:
                body = await read_body(resp)
            except httpx.HTTPError as exc:
                raise _BrokenAnswer(str(exc)) from exc
            finally:
                await resp.aclose()
            replica.outstanding -= 1
            exchange = Exchange(resp.status_code, content_type, body=body)
            if resp.status_code == 200:
                try:
                    exchange.usage.take(_loads(body).get("usage"))
                except (ValueError, AttributeError):
                    pass
                if not exchange.usage.reported and self.counter is not None:
                    exchange.usage.count(self.counter, self.counter.count_body(body))
            return exchange
        blocks = sse_blocks(resp)
        try:
            first = await anext(blocks)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            await resp.aclose()
            raise _BrokenAnswer(str(exc) or "empty stream") from exc
        except BaseException:  # cancelled (a tier's latency budget): free the connection
            await resp.aclose()
            raise
        exchange = Exchange(200, content_type)
        usage = exchange.usage
        closed = False
        # Without a usage report the gateway counts the output itself: the events are kept
        # (references only) until the stream ends, and parsed only if no report came.
        seen: list[bytes] | None = [first] if self.counter is not None else None

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                replica.outstanding -= 1
                usage.resolve()
                await blocks.aclose()
                await resp.aclose()
                if seen is not None and not usage.reported and self.counter is not None:
                    usage.count(self.counter, self.counter.count_stream(seen))

        view = usage_view(fields, self.local_engine)
        exchange.first = _take_usage(first, usage, view)
        exchange.rest = self._relay(blocks, usage, view, replica, seen)
        exchange.close = close
        return exchange

    async def _relay(
        self,
        blocks: AsyncIterator[bytes],
        usage: Usage,
        view: UsageView,
        replica: Replica,
        seen: list[bytes] | None = None,
    ) -> AsyncIterator[bytes]:
        try:
            async for block in blocks:
                if seen is not None and not usage.reported:
                    seen.append(block)
                out = _take_usage(block, usage, view)
                if out:
                    yield out
        except httpx.HTTPError as exc:
            log.warning("stream from replica %s broke: %s", replica.name, exc)
            self.pool.record_failure(replica)
            yield error_event(f"The upstream stream broke: {type(exc).__name__}.")


@functools.lru_cache(maxsize=16)
def _engine_url(path: str) -> httpx.URL:
    return httpx.URL("http://engine" + path)  # parsed once per path


class _BrokenAnswer(Exception):
    """The upstream failed before the first byte of its answer was ready (retryable)."""


class RelayResponse(Response):
    """An ASGI response that relays an :class:`Exchange` stream chunk by chunk, unbuffered.

    A client that disconnects cancels the relay at once (a watcher waits on ``receive``); the
    upstream response is then closed — the engine sees the disconnect and aborts — and
    ``on_close`` (settle or release) runs on every path.
    """

    def __init__(
        self,
        exchange: Exchange,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        # A Response subclass so FastAPI hands it to the server untouched; Response.__init__
        # is not called: there is no body to render.
        self.status_code = exchange.status
        self.background = None
        self.exchange = exchange
        self.raw_headers = headers
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        disconnected = finishing = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    disconnected = True
                    if not finishing and task is not None:
                        task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        exchange = self.exchange
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": exchange.status,
                    "headers": self.raw_headers,
                }
            )
            if exchange.first:
                await send(
                    {"type": "http.response.body", "body": exchange.first, "more_body": True}
                )
            if exchange.rest is not None:
                async for block in exchange.rest:
                    await send({"type": "http.response.body", "body": block, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected or task is None:
                raise
            task.uncancel()
            log.info("client disconnected mid-stream; upstream request closed")
        finally:
            finishing = True
            watcher.cancel()
            try:
                if exchange.close is not None:
                    await exchange.close()
            finally:
                await self.on_close()
