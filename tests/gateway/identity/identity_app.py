"""The test app of the identity tests and the checks they share.

``build_app`` assembles the admin router plus ``/v1/whoami``, a data-plane route that does
nothing but resolve the caller with ``Authenticator.resolve`` and show the Principal.
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Header

from gateway.identity.admin import build_admin_router
from gateway.identity.auth import Authenticator
from portico.http_errors import BodySizeLimitMiddleware, install_error_handlers

ADMIN_KEY = "adm-" + "k" * 40
MAX_BODY_BYTES = 64 * 1024


def build_app(authenticator: Authenticator) -> FastAPI:
    """The admin router plus ``/v1/whoami``, a data-plane route that only resolves the caller."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    app.include_router(build_admin_router(authenticator.store, authenticator))

    @app.get("/v1/whoami")
    async def whoami(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        p = await authenticator.resolve(authorization)
        return {
            "tenant_id": p.tenant_id,
            "key_id": p.key_id,
            "subject": p.subject,
            "plan": p.plan,
            "allowed_models": sorted(p.allowed_models) if p.allowed_models is not None else None,
            "scopes": sorted(p.scopes),
            "is_admin": p.is_admin,
            "cache_salt": p.cache_salt,
            "limits": vars(p.limits),
            "key_limits": vars(p.key_limits) if p.key_limits else None,
            "model_limits": {m: vars(lim) for m, lim in p.model_limits.items()},
        }

    return app


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    """The response is ``status`` with OpenAI's error shape; returns the error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err
