"""Who is calling: the one object authentication hands to the rest of the gateway."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from portico.contract import DEFAULT_TENANT


@dataclass(frozen=True)
class Limits:
    """Quota numbers. ``None`` means unlimited. Units: per minute, per calendar month (UTC);
    ``budget_usd`` is per ``budget_period`` (UTC day or month)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrency: int | None = None
    monthly_token_budget: int | None = None
    max_tokens_default: int | None = None  # the cap reserved when a request sets no max_tokens
    # money: USD spendable per UTC day or month (None: monthly) at the models' prices
    budget_usd: float | None = None
    budget_period: Literal["daily", "monthly"] | None = None


@dataclass(frozen=True)
class EngineShare:
    """What a local engine's scheduler is told about a tenant (its plan's fields): ``weight``
    (> 0) scales its fair share of tokens, ``priority_class`` puts it before (``interactive``)
    or after (``batch``) the other class, ``kv_share`` in (0, 1] caps the fraction of the
    engine's KV blocks its requests may hold, ``max_running`` > 0 caps how many of its
    requests one engine runs at once (0: the engine's slot share alone). The defaults are the
    engine's own."""

    weight: float = DEFAULT_TENANT.weight
    priority_class: Literal["interactive", "batch"] = "interactive"
    kv_share: float = DEFAULT_TENANT.kv_share
    max_running: int = DEFAULT_TENANT.max_running


@dataclass(frozen=True)
class Principal:
    """An authenticated caller.

    ``limits`` is the tenant's plan merged with the tenant's overrides; ``key_limits`` are the
    calling key's own limits, if it has any; ``model_limits`` are optional per-model limits of
    the tenant. ``cache_salt`` is sent to engines so tenants never share prefix-cache entries
    unless their plan gives them the same salt. ``share`` is the plan's scheduling share,
    sent on the engine hop (gateway/relay/engine_hop.py).
    """

    tenant_id: str
    plan: str
    limits: Limits
    key_id: str | None = None
    subject: str | None = None
    allowed_models: frozenset[str] | None = None  # None: every model
    scopes: frozenset[str] = frozenset()
    is_admin: bool = False
    key_limits: Limits | None = None
    model_limits: Mapping[str, Limits] = field(default_factory=lambda: MappingProxyType({}))
    cache_salt: str | None = None
    # the plan's shared prompt prefixes (gateway/identity/cache_salts.py)
    shared_prefixes: tuple[str, ...] = ()
    share: EngineShare = EngineShare()
    image_models: frozenset[str] | None = None  # the plan's image_models; None: every model

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def may_send_images(self, model: str) -> bool:
        return self.image_models is None or model in self.image_models
