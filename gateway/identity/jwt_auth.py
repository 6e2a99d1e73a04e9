"""JWT verification with PyJWT: pinned algorithms, required claims, capped lifetime, JWKS.

What a token must satisfy to pass:

- its ``alg`` is one of the configured algorithms (``none`` can never be configured), and the
  verification key's type matches the algorithm's family (RSA for RS*/PS*, EC for ES*, a
  shared secret for HS*): a public key is never used as an HMAC secret;
- no ``crit`` header (we implement no critical extensions, so any listed one is unsupported);
- ``exp``, ``iat``, ``iss`` and ``aud`` are present and valid (``leeway_seconds`` of clock
  skew), and ``exp - iat`` is at most ``max_lifetime_seconds``;
- with a JWKS URL, its ``kid`` names a key of the set; an unknown kid refreshes the set at
  most once per ``jwks_refresh_cooldown_seconds``.

Every failure raises :class:`portico.errors.AuthenticationError` (401) with a short reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from pydantic import BaseModel, ConfigDict, Field, model_validator

from portico.errors import AuthenticationError

log = logging.getLogger(__name__)

ALGORITHM_FAMILY = {
    "RS256": "RSA",
    "RS384": "RSA",
    "RS512": "RSA",
    "PS256": "RSA",
    "PS384": "RSA",
    "PS512": "RSA",
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "HS256": "oct",
    "HS384": "oct",
    "HS512": "oct",
}
SUPPORTED_CRIT: frozenset[str] = frozenset()
HMAC_SECRET_ENV = "PORTICO_JWT_HMAC_SECRET"
MIN_HMAC_SECRET_BYTES = 32


class JWTSettings(BaseModel):
    """How bearer JWTs are verified. At least one key source must fit the algorithms."""

    model_config = ConfigDict(extra="forbid")

    algorithms: list[str] = Field(default_factory=lambda: ["RS256"], min_length=1)
    issuer: str = Field(min_length=1)
    audience: list[str] = Field(min_length=1)
    public_key_file: Path | None = None
    jwks_url: str | None = None
    hmac_secret_file: Path | None = None
    jwks_cache_seconds: float = Field(default=300.0, gt=0)
    jwks_refresh_cooldown_seconds: float = Field(default=30.0, ge=0)
    jwks_timeout_seconds: float = Field(default=5.0, gt=0)
    leeway_seconds: float = Field(default=30.0, ge=0, le=300)
    max_lifetime_seconds: int = Field(default=3600, gt=0)
    tenant_claim: str = "tenant"
    subject_claim: str = "sub"
    scopes_claim: str = "scope"
    admin_claim: str = "roles"
    admin_role: str = "portico:admin"

    @model_validator(mode="after")
    def _check(self) -> JWTSettings:
        unknown = [a for a in self.algorithms if a not in ALGORITHM_FAMILY]
        if unknown:
            raise ValueError(f"algorithms: unsupported {unknown}; use {sorted(ALGORITHM_FAMILY)}")
        asymmetric = any(ALGORITHM_FAMILY[a] != "oct" for a in self.algorithms)
        if asymmetric and not (self.public_key_file or self.jwks_url):
            raise ValueError("public_key_file or jwks_url is required for RS*/PS*/ES* algorithms")
        if self.jwks_url and not self.jwks_url.startswith(("https://", "http://")):
            raise ValueError("jwks_url must be an http(s) URL")
        return self


@dataclass(frozen=True)
class VerifiedToken:
    """The claims of a token that passed every check."""

    claims: Mapping[str, Any]
    tenant_id: str | None
    subject: str | None
    scopes: frozenset[str]
    is_admin: bool


class JWKSCache:
    """A JWKS document fetched with httpx, cached ``cache_seconds``, keys selected by kid.

    Refreshes (on expiry or for an unknown kid) happen at most once per ``cooldown_seconds``
    and one at a time; a failed fetch keeps the previous keys. ``num_fetches`` counts fetches.
    """

    def __init__(
        self,
        url: str,
        cache_seconds: float,
        cooldown_seconds: float,
        timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self._clock = clock
        self.cache_seconds = cache_seconds
        self.cooldown_seconds = cooldown_seconds
        self._client = httpx.AsyncClient(timeout=timeout_seconds, follow_redirects=False)
        self._keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}  # kid -> (key, declared alg)
        self._fetched_at: float | None = None
        self._attempted_at: float | None = None
        self._lock = asyncio.Lock()
        self.num_fetches = 0

    async def get(self, kid: str) -> tuple[jwt.PyJWK, str | None] | None:
        """The key ``kid`` and the ``alg`` its JWK declares (None if it declares none)."""
        now = self._clock()
        if self._fetched_at is None or now - self._fetched_at > self.cache_seconds:
            await self._refresh()
        key = self._keys.get(kid)
        if key is None:
            await self._refresh()
            key = self._keys.get(kid)
        return key

    async def _refresh(self) -> None:
        started = self._clock()
        async with self._lock:
            if self._attempted_at is not None and (
                self._attempted_at > started
                or self._clock() - self._attempted_at < self.cooldown_seconds
            ):
                return  # someone refreshed while we waited, or we are inside the cool-down
            self._attempted_at = self._clock()
            self.num_fetches += 1
            try:
                resp = await self._client.get(self.url)
                resp.raise_for_status()
                entries = resp.json()["keys"]
                if not isinstance(entries, list):
                    raise ValueError("'keys' is not a list")
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                log.warning("JWKS fetch from %s failed: %s", self.url, type(exc).__name__)
                return
            keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}
            for entry in entries:
                if not isinstance(entry, dict) or not isinstance(entry.get("kid"), str):
                    continue
                try:
                    keys[entry["kid"]] = (jwt.PyJWK(entry), entry.get("alg"))
                except jwt.PyJWTError:
                    continue  # a key type we cannot use; the others still work
            self._keys = keys
            self._fetched_at = self._clock()

    async def aclose(self) -> None:
        await self._client.aclose()


class JWTVerifier:
    """Verifies bearer JWTs against :class:`JWTSettings` (see the module docstring)."""

    def __init__(
        self,
        settings: JWTSettings,
        env: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._pem_key: RSAPublicKey | EllipticCurvePublicKey | None = None
        self._pem_family: str | None = None
        if settings.public_key_file is not None:
            key = load_pem_public_key(settings.public_key_file.read_bytes())
            if isinstance(key, RSAPublicKey):
                self._pem_family = "RSA"
            elif isinstance(key, EllipticCurvePublicKey):
                self._pem_family = "EC"
            else:
                raise ValueError(f"{settings.public_key_file}: not an RSA or EC public key")
            self._pem_key = key
        self._hmac_secret: bytes | None = None
        if any(ALGORITHM_FAMILY[a] == "oct" for a in settings.algorithms):
            self._hmac_secret = _read_hmac_secret(settings.hmac_secret_file, env)
        self._jwks = (
            JWKSCache(
                settings.jwks_url,
                settings.jwks_cache_seconds,
                settings.jwks_refresh_cooldown_seconds,
                settings.jwks_timeout_seconds,
                clock,
            )
            if settings.jwks_url
            else None
        )

    @property
    def jwks(self) -> JWKSCache | None:
        return self._jwks

    async def verify(self, token: str) -> VerifiedToken:
        s = self.settings
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthenticationError("Invalid token: malformed.", code="invalid_token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in s.algorithms:
            raise AuthenticationError("Invalid token: algorithm not allowed.", code="invalid_token")
        crit = header.get("crit")
        if crit is not None and (
            not isinstance(crit, list) or not crit or any(c not in SUPPORTED_CRIT for c in crit)
        ):
            raise AuthenticationError(
                "Invalid token: unsupported critical header.", code="invalid_token"
            )
        key = await self._key_for(alg, header.get("kid"))
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=s.audience,
                issuer=s.issuer,
                leeway=s.leeway_seconds,
                options={"require": ["exp", "iat", "iss", "aud"], "verify_signature": True},
            )
        except jwt.PyJWTError as exc:
            raise AuthenticationError(
                f"Invalid token: {_reason(exc)}", code="invalid_token"
            ) from None
        wrong = _mistyped_claim(claims, s)
        if wrong is not None:
            raise AuthenticationError(
                f"Invalid token: the '{wrong}' claim has the wrong type.", code="invalid_token"
            )
        exp, iat = claims["exp"], claims["iat"]
        if exp - iat > s.max_lifetime_seconds:
            raise AuthenticationError(
                f"Invalid token: lifetime exceeds {s.max_lifetime_seconds} seconds.",
                code="invalid_token",
            )
        tenant = claims.get(s.tenant_claim)
        subject = claims.get(s.subject_claim)
        return VerifiedToken(
            claims=claims,
            tenant_id=tenant if isinstance(tenant, str) and tenant else None,
            subject=subject if isinstance(subject, str) else None,
            scopes=_as_set(claims.get(s.scopes_claim)),
            is_admin=s.admin_role in _as_set(claims.get(s.admin_claim)),
        )

    async def _key_for(self, alg: str, kid: object) -> Any:
        family = ALGORITHM_FAMILY[alg]
        if family == "oct":
            if self._hmac_secret is None:
                raise AuthenticationError("Invalid token: no key.", code="invalid_token")
            return self._hmac_secret
        if self._jwks is not None:
            if not isinstance(kid, str) or not kid:
                raise AuthenticationError("Invalid token: missing kid.", code="invalid_token")
            found = await self._jwks.get(kid)
            if found is None:
                raise AuthenticationError("Invalid token: unknown kid.", code="invalid_token")
            jwk, declared_alg = found
            if jwk.key_type != family or declared_alg not in (None, alg):
                raise AuthenticationError(
                    "Invalid token: key does not fit the algorithm.", code="invalid_token"
                )
            return jwk.key
        if self._pem_key is not None and self._pem_family == family:
            return self._pem_key
        raise AuthenticationError(
            "Invalid token: key does not fit the algorithm.", code="invalid_token"
        )

    async def aclose(self) -> None:
        if self._jwks is not None:
            await self._jwks.aclose()


def _read_hmac_secret(path: Path | None, env: Mapping[str, str]) -> bytes:
    raw = path.read_bytes().strip() if path is not None else env.get(HMAC_SECRET_ENV, "").encode()
    if len(raw) < MIN_HMAC_SECRET_BYTES:
        raise ValueError(
            f"HS* algorithms need a shared secret of at least {MIN_HMAC_SECRET_BYTES} bytes "
            f"(jwt.hmac_secret_file or {HMAC_SECRET_ENV})"
        )
    return raw


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_or_strs(value: object) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(v, str) for v in value)
    )


def _mistyped_claim(claims: dict[str, Any], s: JWTSettings) -> str | None:
    """The first claim whose JSON type is not the one RFC 7519 (or our config) gives it.

    PyJWT converts some claims before comparing them (a numeric string ``exp`` passes its
    check), so the types are checked here, after the signature: a wrongly typed claim is a
    bad credential (401), never an error deeper in."""
    expected = {
        "exp": _is_number,
        "iat": _is_number,
        "nbf": _is_number,
        "iss": lambda v: isinstance(v, str),
        "aud": _is_str_or_strs,
        "jti": lambda v: isinstance(v, str),
        s.subject_claim: lambda v: isinstance(v, str),
        s.tenant_claim: lambda v: isinstance(v, str),
        s.scopes_claim: _is_str_or_strs,
        s.admin_claim: _is_str_or_strs,
    }
    for name, fits in expected.items():
        if name in claims and not fits(claims[name]):
            return name
    return None


def _as_set(value: object) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset(value.split())
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, str))
    return frozenset()


def _reason(exc: jwt.PyJWTError) -> str:
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "expired."
    if isinstance(exc, jwt.InvalidAudienceError):
        return "wrong audience."
    if isinstance(exc, jwt.InvalidIssuerError):
        return "wrong issuer."
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"missing the '{exc.claim}' claim."
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "not yet valid."
    if isinstance(exc, jwt.InvalidSignatureError):
        return "bad signature."
    return "could not be verified."
