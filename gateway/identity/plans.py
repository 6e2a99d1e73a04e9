"""Plans: the named quotas of ``policies/plans.yaml`` and the limit numbers they are made of.

A plan is read once at start-up; a tenant names one and may put overrides on top of it
(:class:`LimitsSpec.over`). The gateway's store never writes plans: they are configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from gateway.identity.principal import EngineShare, Limits
from portico.contract import DEFAULT_TENANT, MAX_RUNNING, MAX_WEIGHT

DEFAULT_PLANS_FILE = Path(__file__).resolve().parents[2] / "policies" / "plans.yaml"

ModelName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^|\s]+$")]
SharedPrefix = Annotated[str, StringConstraints(min_length=16, max_length=100_000)]


def whole_number(value: Any) -> Any:
    """``5257552.0`` as ``5257552``: JSON Schema's ``integer`` (the admin API's document)
    includes floats without a fractional part, and some clients write every number so."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(whole_number), Field(ge=0, le=10**15)]


class LimitsSpec(BaseModel):
    """Quota numbers as the admin API and policy files write them (None: not set)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    max_concurrency: Count | None = None
    monthly_token_budget: Count | None = None
    max_tokens_default: Count | None = None
    # a money budget (USD, at the models' prices) per UTC day or month (default monthly)
    budget_usd: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] | None = None
    budget_period: Literal["daily", "monthly"] | None = None

    def to_limits(self) -> Limits:
        return Limits(**self.model_dump(include=set(LimitsSpec.model_fields)))

    def over(self, base: Limits) -> Limits:
        """``base`` with every number this spec sets put on top."""
        merged = {name: getattr(base, name) for name in LimitsSpec.model_fields}
        merged.update({k: v for k, v in self.model_dump().items() if v is not None})
        return Limits(**merged)


class Plan(LimitsSpec):
    """A named quota from ``policies/plans.yaml``.

    ``weight``, ``priority_class`` and ``kv_share`` are what the local engines' schedulers are
    told about every request of the plan's tenants (:meth:`engine_share`): the tenant's share
    of the engine's tokens when several tenants wait (2.0 gets twice 1.0's), whether it is
    served before (``interactive``) or after (``batch``) the other class, and the largest
    fraction of an engine's KV cache its requests may hold at once, and ``max_running`` the
    most of its requests one engine runs at once (None: no cap of its own; the engine's
    fair policy still gives a tenant its weighted share of the running slots back, see
    docs/internals.md "Slot share").
    """

    name: str = ""
    allowed_models: list[ModelName] | None = None
    # Models the plan's tenants may send images to (docs/vision.md); None: every model they
    # may use, []: none.
    image_models: list[ModelName] | None = None
    share_prefix_cache: bool = False
    # Prompt starts every tenant of the plan shares in the engines' prefix cache (a company's
    # system prompt): the blocks of such a prefix are hashed under the plan's salt, the rest
    # of the request under the tenant's (gateway/identity/cache_salts.py).
    shared_prefixes: list[SharedPrefix] = Field(default_factory=list, max_length=32)
    model_limits: dict[ModelName, LimitsSpec] = Field(default_factory=dict)
    # the engine's own bound (the contract's): a larger weight is a typo
    weight: float = Field(default=DEFAULT_TENANT.weight, gt=0, le=MAX_WEIGHT)
    priority_class: Literal["interactive", "batch"] = "interactive"
    kv_share: float = Field(default=DEFAULT_TENANT.kv_share, gt=0, le=1)
    # the engine's own bound (the contract's)
    max_running: int | None = Field(default=None, ge=1, le=MAX_RUNNING)

    def engine_share(self) -> EngineShare:
        return EngineShare(self.weight, self.priority_class, self.kv_share, self.max_running or 0)


class PlansFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    default_plan: str | None = None
    plans: dict[Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")], Plan]


def load_plans(path: Path | None = None) -> dict[str, Plan]:
    """Read the plans file (the packaged ``policies/plans.yaml`` when ``path`` is None).

    The default plan (``default_plan``, else the first listed) comes first in the returned
    dict. Raises ValueError naming the file and the bad field.
    """
    path = path or DEFAULT_PLANS_FILE
    try:
        raw = yaml.safe_load(path.read_text())
        parsed = PlansFile.model_validate(raw)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"{path}: invalid plans file: {exc}") from exc
    if not parsed.plans:
        raise ValueError(f"{path}: no plans defined")
    default = parsed.default_plan or next(iter(parsed.plans))
    if default not in parsed.plans:
        raise ValueError(f"{path}: default_plan {default!r} is not one of the plans")
    names = [default] + [n for n in parsed.plans if n != default]
    return {n: parsed.plans[n].model_copy(update={"name": n}) for n in names}
