"""Per-address limits against brute force: unauthenticated requests, failed logins, admin API.

Tenant limits (:mod:`gateway.admission.admission`) need a principal; these do not. They count per
client address with slowapi's :class:`~slowapi.Limiter` (the ``limits`` library underneath, moving
window) in the same Redis the gateway uses, so every replica sees the same counts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import limits
import redis.exceptions
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, field_validator
from slowapi import Limiter
from slowapi.util import get_remote_address
from starlette.requests import Request

from portico.errors import RateLimitError

log = logging.getLogger("portico.abuse")

STORAGE_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    ConnectionError,
    TimeoutError,
    OSError,
)


class AbuseSettings(BaseModel):
    """Per-client-address limits, each in the ``limits`` notation ("20/minute", "5 per second")."""

    model_config = ConfigDict(extra="forbid")

    unauthenticated: str = "60/minute"  # requests that carry no credential at all
    failed_auth: str = "10/minute"  # failed authentications; beyond it every attempt gets 429
    admin: str = "120/minute"  # requests to /admin/...

    @field_validator("unauthenticated", "failed_auth", "admin")
    @classmethod
    def _parses(cls, value: str) -> str:
        try:
            limits.parse(value)
        except ValueError as exc:
            raise ValueError(f"not a rate limit like '10/minute': {value!r}") from exc
        return value


def limits_storage_uri(redis_url: str) -> str:
    """The ``limits`` storage URI for a gateway Redis URL (``unix://`` becomes
    ``redis+unix://``; ``redis+cluster://`` and ``redis+sentinel://`` are already its own)."""
    if redis_url.startswith("unix://"):
        return "redis+" + redis_url
    if redis_url.startswith(
        ("redis://", "rediss://", "redis+unix://", "redis+cluster://", "redis+sentinel://")
    ):
        return redis_url
    raise ValueError(f"unsupported Redis URL for the abuse limits: {redis_url!r}")


class AbuseGuard:
    """Counts requests per client address and answers 429 (OpenAI's shape) past a limit.

    Call sites:
      - before authenticating: ``await guard.check_failed_auth(addr)`` (an address that has
        used up its failed attempts gets 429 even with a right key: no oracle for guessing);
      - after a failed authentication: ``await guard.record_failed_auth(addr)``;
      - a request without any credential: ``await guard.hit_unauthenticated(addr)``;
      - the admin router: ``APIRouter(dependencies=[Depends(guard.admin_dependency)])``.

    ``limiter`` is the slowapi :class:`Limiter` itself (``@guard.limiter.limit("5/minute")``
    works on routes that take a ``request``). If Redis cannot be reached the guard lets requests
    through (tenant admission has its own policy) and logs once per outage.
    """

    def __init__(
        self,
        redis_url: str,
        settings: AbuseSettings,
        *,
        registry: CollectorRegistry | None = None,
        socket_timeout: float = 0.25,
    ) -> None:
        self.settings = settings
        # handed to redis-py as keyword arguments (slowapi annotates them as str; they are not)
        storage_options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
        }
        self.limiter = Limiter(
            key_func=get_remote_address,
            storage_uri=limits_storage_uri(redis_url),
            storage_options=storage_options,
            strategy="moving-window",
            key_prefix="portico:abuse",
            headers_enabled=False,
        )
        self._rules = {
            "unauthenticated": limits.parse(settings.unauthenticated),
            "failed_auth": limits.parse(settings.failed_auth),
            "admin": limits.parse(settings.admin),
        }
        self._storage_down = False
        self._rejected = Counter(
            "portico_abuse_rejected",
            "Requests refused by a per-address abuse limit",
            ["rule"],
            registry=registry if registry is not None else CollectorRegistry(),
        )

    async def hit_unauthenticated(self, client_addr: str) -> None:
        """Count a request without credentials; 429 past the limit."""
        await self._hit("unauthenticated", client_addr)

    async def check_failed_auth(self, client_addr: str) -> None:
        """429 if ``client_addr`` has no failed attempts left; counts nothing."""
        rule = self._rules["failed_auth"]
        allowed = await self._storage_call(self.limiter.limiter.test, rule, client_addr)
        if not allowed:
            await self._reject("failed_auth", client_addr)

    async def record_failed_auth(self, client_addr: str) -> None:
        """Count one failed authentication of ``client_addr`` (raises nothing)."""
        rule = self._rules["failed_auth"]
        await self._storage_call(self.limiter.limiter.hit, rule, client_addr)

    async def admin_dependency(self, request: Request) -> None:
        """FastAPI dependency for the admin router: the per-address admin limit."""
        await self._hit("admin", get_remote_address(request))

    async def _hit(self, name: str, client_addr: str) -> None:
        allowed = await self._storage_call(self.limiter.limiter.hit, self._rules[name], client_addr)
        if not allowed:
            await self._reject(name, client_addr)

    async def _storage_call(self, method: Any, rule: limits.RateLimitItem, addr: str) -> bool:
        # The limits library is synchronous; keep its Redis round trip off the event loop.
        try:
            result = await asyncio.to_thread(method, rule, "portico:abuse", addr)
        except STORAGE_DOWN as exc:
            if not self._storage_down:
                self._storage_down = True
                log.warning("abuse limits: Redis unreachable (%s); not enforcing", exc)
            return True
        if self._storage_down:
            self._storage_down = False
            log.warning("abuse limits: Redis reachable again; enforcing")
        return bool(result)

    async def _reject(self, name: str, client_addr: str) -> None:
        rule = self._rules[name]
        retry_s = float(rule.get_expiry())
        try:
            stats = await asyncio.to_thread(
                self.limiter.limiter.get_window_stats, rule, "portico:abuse", client_addr
            )
            retry_s = max(0.001, stats.reset_time - time.time())
        except STORAGE_DOWN:
            pass
        self._rejected.labels(name).inc()
        retry_ms = math.ceil(retry_s * 1000)
        raise RateLimitError(
            f"Too many {name.replace('_', ' ')} requests from your address "
            f"(limit {rule}). Please try again in {math.ceil(retry_s)}s.",
            code="rate_limit_exceeded",
            headers={"retry-after": str(math.ceil(retry_s)), "retry-after-ms": str(retry_ms)},
        )
