"""Graceful drain: count in-flight requests, refuse new ones once draining, wait for the rest."""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from portico.errors import ServiceUnavailableError

# Probes keep answering while draining: /ready says 503 itself, /health stays truthful.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


class DrainState:
    """In-flight request count and the draining flag of one server.

    Used from the event loop only (not thread-safe). ``in_flight`` counts a streaming request
    until its last byte is sent, so a drain waits for whole streams, not just their headers.
    """

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class DrainMiddleware:
    """Tracks every non-probe request in :class:`DrainState`; answers 503 once draining."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = ServiceUnavailableError(
                "The server is shutting down and accepts no new requests; retry elsewhere.",
                code="draining",
            )
            body = json.dumps(error.to_dict()).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()
