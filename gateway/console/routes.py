"""``/admin/ui``: the admin console's page, its static files and its session route.

The page is one HTML file plus one script and one stylesheet shipped in this package (no build
step, nothing fetched from elsewhere). Every response carries a strict Content-Security-Policy
(scripts, styles and fetches from this origin only; no inline code, no frames, no forms posted
elsewhere) and the usual hardening headers. The console's data comes from the admin REST API
(``/admin/v1``) only; this module adds just the session: ``POST /admin/ui/session`` signs in
with the admin key or an admin JWT (JSON body, so a cross-site form cannot post it), ``GET``
tells the page who is signed in and its CSRF token, ``DELETE`` signs out (CSRF token needed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response

from gateway.console.sessions import (
    COOKIE_NAME,
    COOKIE_PATH,
    ConsoleSessions,
    Session,
)
from gateway.identity.audit import Actor, AuditLog
from portico.errors import AuthenticationError, InvalidRequestError, NotFoundError

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}


class SignIn(BaseModel):
    """Body of ``POST /admin/ui/session``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    credential: str = Field(min_length=1, max_length=8192)


def _harden(response: Response, *, cache: bool = False) -> Response:
    response.headers.update(SECURITY_HEADERS)
    response.headers["cache-control"] = "no-cache" if cache else "no-store"
    return response


def _session_body(session: Session) -> dict[str, Any]:
    return {
        "object": "console_session",
        "actor": session.actor,
        "actor_kind": session.kind,
        "csrf_token": session.csrf_token,
        "expires_at": session.expires_at,
    }


def build_console_router(
    sessions: ConsoleSessions,
    audit: AuditLog,
    *,
    secure_cookies: bool,
    before_auth: Callable[[Request], Awaitable[None]] | None = None,
) -> APIRouter:
    """The console's routes. ``secure_cookies``: the gateway terminates TLS, so the session
    cookie is marked Secure (a request that arrived over https gets it Secure either way)."""
    router = APIRouter(prefix="/admin/ui", include_in_schema=False)

    @router.get("")
    async def console_page() -> Response:
        return _harden(FileResponse(STATIC_DIR / "index.html", media_type="text/html"))

    @router.get("/")
    async def console_slash() -> Response:
        return _harden(RedirectResponse("/admin/ui", status_code=308))

    @router.get("/static/{name}")
    async def static_file(name: str) -> Response:
        media_type = STATIC_FILES.get(name)
        if media_type is None:
            raise NotFoundError(f"No console file {name!r}.", code="not_found")
        response = FileResponse(STATIC_DIR / name, media_type=media_type)
        return _harden(response, cache=True)

    @router.post("/session")
    async def sign_in(request: Request) -> Response:
        if before_auth is not None:  # the per-address admin limit counts guesses here too
            await before_auth(request)
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise InvalidRequestError(
                'Sign in with a JSON body: {"credential": ...}.', param="content-type"
            )
        try:
            body = SignIn.model_validate_json(await request.body())
        except ValidationError:
            raise InvalidRequestError(
                'The body must be {"credential": "<admin key or admin JWT>"}.',
                param="credential",
            ) from None
        session_id, session = await sessions.sign_in(body.credential.strip())
        address = request.client.host if request.client else "unknown"
        await audit.record(
            Actor(session.actor, session.kind, address), "console.sign_in", "console"
        )
        response = _harden(JSONResponse(_session_body(session)))
        response.set_cookie(
            COOKIE_NAME,
            session_id,
            max_age=max(1, int(session.expires_at - sessions.clock())),
            path=COOKIE_PATH,
            secure=secure_cookies or request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @router.get("/session")
    async def current_session(request: Request) -> Response:
        session = await sessions.find(request.cookies.get(COOKIE_NAME))
        if session is None:
            raise AuthenticationError("Not signed in.", code="not_signed_in")
        return _harden(JSONResponse(_session_body(session)))

    @router.delete("/session")
    async def sign_out(request: Request) -> Response:
        await sessions.resolve_admin(request)  # a live session and its CSRF token
        await sessions.sign_out(request.cookies.get(COOKIE_NAME))
        response = _harden(Response(status_code=204))
        response.delete_cookie(COOKIE_NAME, path=COOKIE_PATH, httponly=True, samesite="strict")
        return response

    return router
