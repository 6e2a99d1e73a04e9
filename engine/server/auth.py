"""Bearer-key authentication for the engine server (``--api-key``)."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from portico.errors import AuthenticationError

# Probes and scrapers must work without the key: orchestrators and Prometheus do not carry it.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyMiddleware:
    """Answers 401 (OpenAI's shape) unless ``Authorization: Bearer <api_key>`` matches.

    The comparison is constant-time over the UTF-8 bytes. Every path except
    :data:`OPEN_PATHS` is guarded, unknown paths included, so the key guards the whole surface.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.is_authorized(dict(scope["headers"]).get(b"authorization", b"")):
            await self.app(scope, receive, send)
            return
        error = AuthenticationError(
            "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'."
        )
        body = json.dumps(error.to_dict()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def is_authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self.expected)
