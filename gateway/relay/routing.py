"""Which upstream serves a request: an explicit model, an alias, or ``auto`` by complexity.

``Router.route`` returns a :class:`RouteDecision`; the proxy carries it out. For ``auto`` the
router scores the request from cheap features — estimated prompt tokens (chars / 4: the tier,
and so the tokenizer, is not known yet), max_tokens, user turns, fenced code blocks, tools, and
configured keywords — as a weighted sum, and takes the first tier (in policy order) whose
``max_score`` is at least the score and whose model the caller may use. The policy lives in
``policies/routing.yaml``.

Fallbacks: a tier may list other tiers (``fallbacks``) to try, in order, when it is down (no
healthy replica, connection failures after the retries, 5xx), out of quota (429, or a
model-scoped limit of the tenant refused it at admission) or slower to its first byte than its
``latency_budget_s``. The decision carries them; the gateway tries them
only before the first byte reached the client (``gateway/app.py``), and ``x-portico-route``
names the tier that answered and the ones it fell back from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.body.fields import RequestFields, prefix_text, prompt_text
from gateway.identity.principal import Principal
from portico.errors import NotFoundError, PermissionDeniedError

AUTO_MODEL = "auto"
log = logging.getLogger("portico.gateway.routing")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Weights(_Strict):
    """Score per unit of each feature."""

    prompt_tokens: float = 0.001
    max_tokens: float = 0.001
    turns: float = 0.1
    code_blocks: float = 1.0
    tools: float = 1.0
    keywords: float = 1.0


class Tier(_Strict):
    """A named destination: a local pool or remote upstream (by model name)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = Field(min_length=1)
    max_score: float | None = None  # None: catches everything (the last tier)
    fallbacks: list[str] = []  # tier names to try next, in order, before the first byte
    latency_budget_s: float | None = Field(default=None, gt=0, le=3600)  # to the first byte


class RoutingPolicy(_Strict):
    """Aliases, the ``auto`` tiers and scoring, and prefix-affinity numbers."""

    aliases: dict[str, str] = {}
    tiers: list[Tier] = []
    weights: Weights = Weights()
    keywords: list[str] = []
    prefix_chars: int = Field(default=256, ge=0, le=100_000)
    affinity_slack: int = Field(default=2, ge=0, le=10_000)
    # how a pool picks a replica (gateway/fleet/pool.py): least_loaded (with the prefix
    # affinity above), prefix_aware (the engines' cached blocks, gateway/fleet/prefix_index.py),
    # round_robin
    replica_policy: Literal["prefix_aware", "least_loaded", "round_robin"] = "least_loaded"

    @model_validator(mode="after")
    def _fallbacks_name_tiers(self) -> RoutingPolicy:
        names = [t.name for t in self.tiers]
        for tier in self.tiers:
            unknown = [f for f in tier.fallbacks if f not in names or f == tier.name]
            if unknown:
                raise ValueError(f"tier {tier.name}: fallbacks name no other tier: {unknown}")
        return self


def load_routing_policy(path: Path) -> RoutingPolicy:
    """Read ``routing.yaml``; a missing file gives a policy with no aliases and no tiers."""
    if not path.is_file():
        return RoutingPolicy()
    return RoutingPolicy.model_validate(yaml.safe_load(path.read_text()) or {})


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where to send a request and why (the ``x-portico-route`` header shows both)."""

    tier: str
    model: str  # the upstream's model name (a pool or a remote upstream)
    reason: str
    prefix_key: bytes | None
    fallbacks: tuple[Tier, ...] = ()  # tiers to try next, before the first byte
    latency_budget_s: float | None = None

    @property
    def header(self) -> str:
        return f"tier={self.tier}; model={self.model}; reason={self.reason}"

    def fall_back(self, why: str) -> RouteDecision:
        """The decision for the next fallback tier (there must be one); the reason keeps the
        route so far: ``...; fallback from small (no_healthy_replica)``."""
        tier, rest = self.fallbacks[0], self.fallbacks[1:]
        reason = f"{self.reason}; fallback from {self.tier} ({why})"
        return RouteDecision(
            tier.name, tier.model, reason, self.prefix_key, rest, tier.latency_budget_s
        )


@dataclass(frozen=True, slots=True)
class Features:
    """The inputs of the complexity score."""

    prompt_tokens: int
    max_tokens: int
    turns: int
    code_blocks: int
    tools: int
    keywords: int


class Router:
    """Routes requests over the models the gateway serves, under one routing policy."""

    def __init__(self, policy: RoutingPolicy, models: set[str], *, strict: bool = True) -> None:
        """``strict``: a tier or alias naming a model that is not served is an error; otherwise
        (the packaged default policy in front of a user's own models) it is dropped and logged."""
        unknown = [t.model for t in policy.tiers if t.model not in models]
        unknown += [m for m in policy.aliases.values() if m not in models]
        served = {t.name for t in policy.tiers if t.model in models}
        if unknown and strict:
            raise ValueError(f"routing policy names models that are not served: {unknown}")
        if unknown:
            log.warning(
                "routing policy: ignoring tiers/aliases of models not served: %s",
                sorted(set(unknown)),
            )
            policy = policy.model_copy(
                update={
                    "tiers": [
                        t.model_copy(update={"fallbacks": [f for f in t.fallbacks if f in served]})
                        for t in policy.tiers
                        if t.model in models
                    ],
                    "aliases": {a: m for a, m in policy.aliases.items() if m in models},
                }
            )
        self.policy = policy
        self.models = models
        self._keywords = [k.lower() for k in policy.keywords]
        self._tiers = {t.name: t for t in policy.tiers}

    def model_cards(self, principal: Principal) -> list[dict[str, Any]]:
        """``GET /v1/models``: one card per served model the caller may use, listing the
        aliases that name it (``aliases``), so a model picker shows each model once; then
        ``auto`` (when a tier's model is allowed) with the models it routes to
        (``routes_to``). An alias gets a card of its own (``alias_of``) only when the plan
        allows the alias and not its model."""
        cards = []
        for model in sorted(self.models):
            aliases = sorted(a for a, m in self.policy.aliases.items() if m == model)
            if principal.may_use(model):
                cards.append(model_card(model, aliases=aliases))
            else:
                cards += [model_card(a, alias_of=model) for a in aliases if principal.may_use(a)]
        tiers = [t.model for t in self.policy.tiers if principal.may_use(t.model)]
        if tiers:
            cards.append(model_card(AUTO_MODEL, routes_to=sorted(set(tiers))))
        return cards

    def find_card(self, name: str, principal: Principal) -> dict[str, Any] | None:
        """``GET /v1/models/{name}``: a served model's card as listed, an alias's with
        ``alias_of``, ``auto``'s; None when the caller may not use it or it does not exist."""
        if name == AUTO_MODEL:
            return next((c for c in self.model_cards(principal) if c["id"] == name), None)
        target = self.policy.aliases.get(name)
        if target is not None and (principal.may_use(target) or principal.may_use(name)):
            return model_card(name, alias_of=target)
        if name in self.models and principal.may_use(name):
            return next(c for c in self.model_cards(principal) if c["id"] == name)
        return None

    def route(self, fields: RequestFields, principal: Principal) -> RouteDecision:
        name = fields.model
        if name == AUTO_MODEL and self.policy.tiers:
            return self._route_auto(fields, principal)
        if name in self.models:
            model, reason = name, "explicit"
        elif name in self.policy.aliases:
            model, reason = self.policy.aliases[name], f"alias:{name}"
        else:
            raise NotFoundError(f"The model '{name}' does not exist.", param="model")
        if not (principal.may_use(model) or principal.may_use(name)):  # plans may name aliases
            raise PermissionDeniedError(
                f"Your plan does not allow the model '{name}'.",
                param="model",
                code="model_not_allowed",
            )
        return RouteDecision("direct", model, reason, self.prefix_key(fields))

    def features(self, fields: RequestFields) -> Features:
        text = prompt_text(fields)
        lowered = text.lower()
        turns = sum(1 for m in fields.messages or () if m.get("role") == "user") or 1
        return Features(
            prompt_tokens=len(text) // 4,
            max_tokens=fields.max_tokens or 0,
            turns=turns,
            code_blocks=text.count("```") // 2,
            tools=fields.num_tools,
            keywords=sum(1 for k in self._keywords if k in lowered),
        )

    def score(self, f: Features) -> float:
        w = self.policy.weights
        return (
            w.prompt_tokens * f.prompt_tokens
            + w.max_tokens * f.max_tokens
            + w.turns * f.turns
            + w.code_blocks * f.code_blocks
            + w.tools * f.tools
            + w.keywords * f.keywords
        )

    def _route_auto(self, fields: RequestFields, principal: Principal) -> RouteDecision:
        f = self.features(fields)
        score = self.score(f)
        allowed = [t for t in self.policy.tiers if principal.may_use(t.model)]
        if not allowed:
            raise PermissionDeniedError(
                "Your plan allows none of the models 'auto' routes to.",
                param="model",
                code="model_not_allowed",
            )
        tier = next(
            (t for t in allowed if t.max_score is None or score <= t.max_score), allowed[-1]
        )
        reason = (
            f"auto score={score:.2f} (prompt_tokens~{f.prompt_tokens} "
            f"max_tokens={f.max_tokens} turns={f.turns} code={f.code_blocks} "
            f"tools={f.tools} keywords={f.keywords})"
        )
        fallbacks = tuple(
            self._tiers[name]
            for name in tier.fallbacks
            if principal.may_use(self._tiers[name].model)
        )
        return RouteDecision(
            tier.name,
            tier.model,
            reason,
            self.prefix_key(fields),
            fallbacks,
            tier.latency_budget_s,
        )

    def prefix_key(self, fields: RequestFields) -> bytes | None:
        if not self.policy.prefix_chars:
            return None
        text = prefix_text(fields, self.policy.prefix_chars)
        return text.encode() if text else None


def model_card(name: str, owned_by: str = "portico", **extra: Any) -> dict[str, Any]:
    """One entry of ``/v1/models`` in OpenAI's shape, with Portico's extra fields
    (``aliases``, ``alias_of``, ``routes_to``, ``parent``: the OpenAI SDK keeps them)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": owned_by, **extra}
