"""The gateway's HTTP/1.1 protocol: uvicorn's httptools parser with header size limits.

Without nginx in front, the gateway is the edge, so it must refuse what nginx would: a header
line over ``max_header_line_bytes`` or a header block over ``max_header_bytes`` gets 431
(RFC 6585) and the connection is closed before the app sees the request. The block is counted
as bytes arrive, so a client cannot make the parser buffer a megabyte header it never ends.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.lean_cycle import LeanCycle
from gateway.relay.hot_routes import HOT_PATHS, GatewayApp
from gateway.tls import TLSScopeProtocol
from portico.errors import error_body

DEFAULT_MAX_HEADER_LINE_BYTES = 8 * 1024  # nginx's large_client_header_buffers: 8k a line
DEFAULT_MAX_HEADER_BYTES = 32 * 1024  # ... and 4 of them


class LimitedHeadersProtocol(TLSScopeProtocol):
    """``TLSScopeProtocol`` that answers 431 for an oversized header line or header block.

    The limits are read from the uvicorn config (``max_header_line_bytes``,
    ``max_header_bytes`` attributes set by gateway.server); the defaults are nginx's. A parser
    callback that finds a limit crossed records why and fails the parse; uvicorn then answers
    the parse error through ``send_400_response``, which sends the 431 instead.

    A ``POST`` on a hot route (``HOT_PATHS``) is answered through :class:`LeanCycle`, and, when
    the app is the gateway's, handed to its ``hot_app`` directly, as ``GatewayApp`` would hand
    it (uvicorn's ``ProxyHeadersMiddleware`` and ``GatewayApp.__call__`` are two coroutines on
    every suspension of the request); a request whose forwarded headers that middleware would
    read (from a trusted proxy) goes the whole way.

    The keep-alive timeout is kept by one timer per connection that re-arms itself (as nginx
    keeps its timers), not by a timer made on every response and cancelled by the next
    request: an idle connection still closes ``timeout_keep_alive`` seconds after its last
    response, and a connection busy with a request never does.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._max_line = int(
            getattr(config, "max_header_line_bytes", DEFAULT_MAX_HEADER_LINE_BYTES)
        )
        self._max_block = int(getattr(config, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES))
        self._too_large: str | None = None
        self._in_head = True
        self._head_bytes = 0
        self._block_bytes = 0
        app: Any = self.app
        trusted = None
        if isinstance(app, ProxyHeadersMiddleware):
            app, trusted = app.app, app.trusted_hosts
        self._gateway_app = app if isinstance(app, GatewayApp) else None
        self._trusted_proxies = trusted
        self._idle_since: float | None = None  # when the last response ended; None: busy
        self._idle_timer: asyncio.TimerHandle | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        super().data_received(data)
        if self._in_head and self._too_large is None and not self.transport.is_closing():
            # an unfinished head: the parser buffers it, so bound it as it grows
            self._head_bytes += len(data)
            if self._head_bytes > self._max_line + self._max_block:
                self._send_431(f"The request's headers are over {self._max_block} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._block_bytes = 0

    def _refuse(self, message: str) -> None:
        self._too_large = message
        raise ValueError(message)  # fails feed_data; uvicorn calls send_400_response

    def on_url(self, url: bytes) -> None:
        if len(self.url) + len(url) > self._max_line:
            self._refuse(f"The request line is over {self._max_line} bytes.")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        line = len(name) + len(value) + 4  # "name: value\r\n"
        if line > self._max_line:
            self._refuse(f"A request header line is over {self._max_line} bytes.")
        self._block_bytes += line
        if self._block_bytes > self._max_block:
            self._refuse(f"The request's headers are over {self._max_block} bytes.")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope: Any = cycle.scope
        if scope["method"] == "POST" and scope["path"] in HOT_PATHS:
            if type(cycle) is RequestResponseCycle:
                cycle.__class__ = LeanCycle
            gateway_app = self._gateway_app
            hot = gateway_app.hot_app if gateway_app is not None else None
            if hot is not None and app is self.app and not self._forwarded(scope):
                scope["app"] = gateway_app  # what GatewayApp.__call__ sets
                app = hot
        super()._start_asgi_task(cycle, app)

    def _forwarded(self, scope: Any) -> bool:
        """Whether uvicorn's ``ProxyHeadersMiddleware`` would read this request's forwarded
        headers: it came from a trusted proxy and has ``x-forwarded-for`` or ``-proto``."""
        trusted = self._trusted_proxies
        if trusted is None:
            return False
        client = scope.get("client")
        if (client[0] if client else None) not in trusted:
            return False
        for name, _ in scope["headers"]:
            if name == b"x-forwarded-for" or name == b"x-forwarded-proto":
                return True
        return False

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive timer armed once and re-armed by itself (_check_idle)
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._check_idle)

    def _check_idle(self) -> None:
        """Close the connection idle for ``timeout_keep_alive`` since its last response; else
        look again when it would be (a busy one: a whole timeout later)."""
        self._idle_timer = None
        if self.transport.is_closing():
            return
        delay = float(self.timeout_keep_alive)
        if self._idle_since is not None:
            delay += self._idle_since - self.loop.time()
            if delay <= 0:
                self.timeout_keep_alive_handler()
                return
        self._idle_timer = self.loop.call_later(delay, self._check_idle)

    def send_400_response(self, msg: str) -> None:
        if self._too_large is not None:
            self._send_431(self._too_large)
        else:
            super().send_400_response(msg)

    def _send_431(self, message: str) -> None:
        body = json.dumps(
            error_body(message, "invalid_request_error", code="request_header_fields_too_large")
        ).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
