"""Forwarding to a pool of OpenAI-compatible servers: replica choice, retries before the first
byte, SSE relay. The pool is a local engine pool, or (``gateway/remotes/openai_remote.py``) the
endpoints of a remote OpenAI-compatible provider reached over the same lean transport.

``LocalUpstream.exchange`` runs the attempt loop: pick a replica (prefix affinity, least
outstanding), send, and retry on connect errors, broken answers and the policy's statuses
(502/503/504, engine 429) — with full-jitter backoff, a maximum number of attempts and an
overall deadline — but only until the first byte is ready for the client. For a stream the
first SSE event is read inside the loop, so an engine that dies before answering is retried
like any other failure. Once an :class:`Exchange` is returned nothing is retried; a stream
broken later ends with an error event and ``data: [DONE]``.

Usage for settlement: the engine is always asked for ``stream_options.include_usage``; the
usage event is read by the relay (``gateway/relay/usage_relay.py``) and dropped from what
the client gets when it did not ask for it. An upstream that reports no usage (some remote
providers' streams) is counted by the upstream's
:class:`~gateway.relay.output_tokens.OutputCounter`, when it has one, and ``Usage.source``
says how.

Every request to a local engine names the caller's tenant and plan share in ``x-portico-*``
headers (gateway/relay/engine_hop.py); upstream headers are built from scratch, so a
client's own never travel.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from starlette.responses import Response

from gateway.body.fields import RequestFields
from gateway.fleet.pool import Pool, Replica
from gateway.fleet.prefix_index import RouteTokens, route_token_ids
from gateway.fleet.replica_load import Lease
from gateway.identity.principal import Principal
from gateway.metrics import GatewayMetrics
from gateway.relay.carried_prompt import carried_prompt_ids, with_prompt_ids
from gateway.relay.engine_hop import engine_hop_headers
from gateway.relay.output_tokens import OutputCounter
from gateway.relay.retry import RetryPolicy
from gateway.relay.stream_relay import SseEvents, StreamRest
from gateway.relay.transport import (
    HttpxAnswer,
    LeanTransport,
    UpstreamAnswer,
    header_text,
    request_head,
    request_start,
)
from gateway.relay.usage_relay import (
    Usage,
    _loads,
    _take_usage,
    engine_salt,
    upstream_body,
    usage_view,
)
from portico.contract import (
    PROMPT_IDS_HEADER,
    SHARED_PREFIX_HEADER,
    shared_prefix_header,
    tokenizer_fingerprint,
)
from portico.errors import ServiceUnavailableError, UpstreamError

log = logging.getLogger("portico.gateway.proxy")
# The longest a request waits for another request's first token before it is sent to compute
# the blocks they share itself (gateway/fleet/replica_load.py, ``Lease.follows``).
FOLLOW_WAIT_S = 10.0


@dataclass(eq=False)
class Exchange:
    """An upstream answer whose first byte is ready: relay ``body`` or ``first`` + ``rest``.

    A stream whose whole answer arrived with its first block has ``rest`` None.
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


class Upstream(Protocol):
    """Where the gateway forwards a routed request: a local engine pool (:class:`LocalUpstream`),
    an OpenAI-compatible remote over the same transport
    (:class:`~gateway.remotes.openai_remote.OpenAIRemoteUpstream`) or a provider that needs
    translation (:class:`~gateway.remotes.remote.RemoteUpstream`, litellm). All retry only
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
        # the tokenizer admission counts this model with, loaded from the engine's own model
        # folder (set at start-up): the prompt ids it made are carried to the engine
        self.carry_tokenizer: Any | None = None
        self._fingerprint: str | None = None  # carry_tokenizer's (portico/contract.py)
        self._starts: dict[str, str] = {}  # path -> request line and host (request_start)

    def payload(
        self,
        raw: bytes,
        fields: RequestFields,
        model: str,
        cache_salt: str | None,
        max_tokens: int | None,
    ) -> bytes:
        """The body the engine gets (:func:`upstream_body`), with the prompt's token ids where
        admission's are certainly the engine's (gateway/relay/carried_prompt.py)."""
        body = upstream_body(raw, fields, model, cache_salt, max_tokens, self.local_engine)
        ids = carried_prompt_ids(self.carry_tokenizer, fields) if self.local_engine else None
        fields.ids_carried = ids is not None  # an earlier tier's body is not this one's
        return body if ids is None else with_prompt_ids(body, ids)

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
        salt = engine_salt(fields, tenant_salt) if tenant_salt is not None else None
        tenant = principal.tenant_id if principal is not None else None
        return RouteTokens(token_ids, salt, tenant=tenant, model=fields.model)

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

    def _hop_headers(
        self,
        fields: RequestFields,
        request_id: str,
        credential: str | None,
        principal: Principal | None,
    ) -> dict[str, str]:
        """:meth:`request_headers` plus what a local engine is told of this request: its
        shared prefix, and that :meth:`payload` carried its prompt's token ids."""
        headers = self.request_headers(request_id, credential, principal)
        if self.local_engine and fields.shared_prefix is not None:
            salt, num_chars = fields.shared_prefix
            headers[SHARED_PREFIX_HEADER] = shared_prefix_header(num_chars, salt)
        if self.local_engine and fields.ids_carried:
            if self._fingerprint is None:
                self._fingerprint = tokenizer_fingerprint(self.carry_tokenizer)
            headers[PROMPT_IDS_HEADER] = self._fingerprint
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
        headers = self._hop_headers(fields, request_id, credential, principal)
        url = self.request_url(path)
        start = self._starts.get(path)
        if start is None:  # written once per path
            start = self._starts[path] = request_start("POST", url)
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
                lease = self.pool.acquire(replica, tokens)
                lease.streamed = fields.stream
                try:
                    if self.tracer is None:
                        result = await self._attempt(
                            replica, url, payload, headers, fields, lease, start
                        )
                    else:
                        result = await self.tracer.attempt(
                            functools.partial(self._attempt, lease=lease, start=start),
                            replica, url, payload, headers, fields,
                        )  # fmt: skip
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
        raise self._gave_up(reason, attempt)

    def _gave_up(self, reason: str, attempt: int) -> ServiceUnavailableError | UpstreamError:
        """The error once no attempt is left: no replica at all (503, try again), or none
        that answered."""
        if reason == "no_replica":
            return ServiceUnavailableError(
                f"No healthy replica of '{self.pool.name}' is available; try again shortly.",
                code="no_healthy_replica",
                headers={"retry-after": "1"},
            )
        return UpstreamError(
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
        lease: Lease,
        start: str,
    ) -> Exchange:
        # The caller took ``lease`` on the replica; every path below that does not hand the
        # open stream to ``close`` releases it.
        try:
            leader = lease.follows
            if leader is not None and leader.streamed:  # its prefill is ours: let it finish
                await leader.wait_prefilled(FOLLOW_WAIT_S)
            return await self._attempt_open(replica, url, payload, headers, fields, lease, start)
        except BaseException:
            lease.release()
            raise

    async def _send(
        self, replica: Replica, url: httpx.URL, payload: bytes, headers: dict[str, str], start: str
    ) -> UpstreamAnswer:
        """One request to ``replica``; its answer once the head is in. The lean transport gets
        the head as bytes (no httpx models); any other transport goes through httpx."""
        transport = replica.transport
        if isinstance(transport, LeanTransport):
            head = request_head(start, headers, len(payload))
            return await transport.request(head, payload, replica.timeouts)
        if transport is not None:
            request = httpx.Request(
                "POST", url, headers=headers, content=payload,
                extensions={"timeout": replica.timeouts},
            )  # fmt: skip
            return HttpxAnswer(await transport.handle_async_request(request))
        client = replica.client
        request = client.build_request("POST", url, content=payload, headers=headers)
        return HttpxAnswer(await client.send(request, stream=True))

    async def _attempt_open(
        self,
        replica: Replica,
        url: httpx.URL,
        payload: bytes,
        headers: dict[str, str],
        fields: RequestFields,
        lease: Lease,
        start: str,
    ) -> Exchange:
        resp = await self._send(replica, url, payload, headers, start)
        content_type = header_text(resp.header(b"content-type"), "application/json")
        if not fields.stream or resp.status_code != 200:
            try:
                body = await resp.read()
            except httpx.HTTPError as exc:
                raise _BrokenAnswer(str(exc)) from exc
            finally:
                await resp.aclose()
            lease.release()
            exchange = Exchange(resp.status_code, content_type, body=body)
            if resp.status_code == 200:
                try:
                    exchange.usage.take(_loads(body).get("usage"))
                except (ValueError, AttributeError):
                    pass
                if not exchange.usage.reported and self.counter is not None:
                    exchange.usage.count(self.counter, self.counter.count_body(body))
            return exchange
        events = SseEvents(resp)
        try:
            first = await events.next_block()
        except httpx.HTTPError as exc:
            await resp.aclose()
            raise _BrokenAnswer(str(exc)) from exc
        except BaseException:  # cancelled (a tier's latency budget): free the connection
            await resp.aclose()
            raise
        if first is None:
            await resp.aclose()
            raise _BrokenAnswer("empty stream")
        if first.count(b"\n\n") > 1:  # more than the role event: the first token is out
            lease.first_token()
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
                lease.release()
                usage.resolve()
                await resp.aclose()
                if seen is not None and not usage.reported and self.counter is not None:
                    usage.count(self.counter, self.counter.count_stream(seen))

        view = usage_view(fields, self.local_engine)
        exchange.first = _take_usage(first, usage, view)
        if not events.finished:  # else the whole answer is in hand: nothing left to relay
            exchange.rest = StreamRest(events, usage, view, seen, lease, self.pool, replica)
        exchange.close = close
        return exchange


@functools.lru_cache(maxsize=16)
def _engine_url(path: str) -> httpx.URL:
    return httpx.URL("http://engine" + path)  # parsed once per path


class _BrokenAnswer(Exception):
    """The upstream failed before the first byte of its answer was ready (retryable)."""


class RelayResponse(Response):
    """An ASGI response that relays an :class:`Exchange` stream chunk by chunk, unbuffered.

    A client that disconnects cancels the relay at once (a watcher waits on ``receive``); the
    upstream response is then closed — the engine sees the disconnect and aborts — and
    ``on_close`` (settle or release) runs on every path. A stream whose whole answer is in
    hand (``rest`` None) waits on no upstream, so it needs no watcher: its one block and the
    end of the body leave in one send.
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
        exchange = self.exchange
        if exchange.rest is None:
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": exchange.status,
                        "headers": self.raw_headers,
                    }
                )
                body = exchange.first or b""
                await send({"type": "http.response.body", "body": body, "more_body": False})
            finally:
                await self._close()
            return
        await self._relay(receive, send)

    async def _close(self) -> None:
        """Close the upstream answer (frees the replica), then ``on_close``, on every path."""
        try:
            if self.exchange.close is not None:
                await self.exchange.close()
        finally:
            await self.on_close()

    async def _relay(self, receive: Any, send: Any) -> None:
        """Relay ``first`` then ``rest`` as they come, a watcher cancelling on disconnect."""
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
            # the first block even when empty (its events' usage hidden): the server may hold
            # the head for the first body message (gateway/lean_cycle.py), and an empty chunk
            # adds no byte to the wire
            await send(
                {"type": "http.response.body", "body": exchange.first or b"", "more_body": True}
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
            await self._close()
