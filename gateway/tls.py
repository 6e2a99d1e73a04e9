"""TLS details uvicorn leaves to us: TLS 1.2 as the floor, the client certificate in the ASGI
scope (the ASGI TLS extension, ``scope["extensions"]["tls"]["client_cert_chain"]``), and a guard
that makes the admin API require a verified client certificate.

With ``ssl_cert_reqs=CERT_OPTIONAL`` and a CA file, a client may connect without a certificate;
one that presents a certificate the CA did not sign fails the handshake. So a certificate in
the scope is a verified one, and data-plane clients need none.
"""

from __future__ import annotations

import ssl
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from portico.errors import PermissionDeniedError
from portico.http_errors import error_response


class Tls12Config(uvicorn.Config):
    """uvicorn's config with TLS 1.2 as the minimum protocol version."""

    def load(self) -> None:
        super().load()
        if self.ssl is not None:
            self.ssl.minimum_version = ssl.TLSVersion.TLSv1_2


class TLSScopeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, adding the peer's verified certificate to each scope."""

    _client_cert_chain: list[str] = []

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        self._client_cert_chain = [ssl.DER_cert_to_PEM_cert(der)] if der else []

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {"tls": {"client_cert_chain": self._client_cert_chain}}


def client_cert_chain(scope: Any) -> list[str]:
    return list(scope.get("extensions", {}).get("tls", {}).get("client_cert_chain") or ())


class AdminClientCertGuard:
    """403 (OpenAI's shape) for ``/admin/`` requests that arrived without a client certificate."""

    def __init__(self, app: Any, prefix: str = "/admin/") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(self.prefix)
            and not client_cert_chain(scope)
        ):
            error = PermissionDeniedError(
                "The admin API requires a client certificate signed by the configured CA.",
                code="client_certificate_required",
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)
