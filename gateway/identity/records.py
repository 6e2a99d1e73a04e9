"""The records identity keeps in Redis (tenants, API keys) and the admin API bodies that make them.

A key record holds the HMAC of its secret, never the secret; the secret (``sk-`` + 256 random
bits) exists only in the response that creates it. Validation happens here, at the edge:
bodies are strict and forbid unknown fields, so the store trusts what it receives.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from gateway.identity.plans import LimitsSpec, ModelName, whole_number
from portico.errors import APIError

TenantId = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")]
Scope = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9:._*-]{0,63}$")]


class ConflictError(APIError):
    """409: the resource already exists."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class Tenant(BaseModel):
    """A tenant record. ``overrides`` sit on top of the plan's limits; ``allowed_models`` and
    ``share_prefix_cache`` replace the plan's when set (None: inherit)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    name: str
    plan: str
    disabled: bool = False
    allowed_models: list[str] | None = None
    overrides: LimitsSpec = Field(default_factory=LimitsSpec)
    model_limits: dict[str, LimitsSpec] = Field(default_factory=dict)
    share_prefix_cache: bool | None = None
    created: int = 0
    uid: str = ""  # random per creation: a key of a deleted tenant never works for a new
    # tenant that reuses the id (keys record the uid they were made under)


class TenantCreate(BaseModel):
    """Body of ``POST /admin/v1/tenants``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: TenantId | None = None
    name: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    plan: str | None = None
    disabled: bool = False
    allowed_models: list[ModelName] | None = None
    overrides: LimitsSpec = Field(default_factory=LimitsSpec)
    model_limits: dict[ModelName, LimitsSpec] = Field(default_factory=dict)
    share_prefix_cache: bool | None = None


class TenantPatch(BaseModel):
    """Body of ``PATCH /admin/v1/tenants/{id}``: only the fields present change; an
    ``overrides`` field set to null clears that override; ``allowed_models: null`` inherits
    the plan's list again."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    plan: str | None = None
    disabled: bool | None = None
    allowed_models: list[ModelName] | None = None
    overrides: LimitsSpec | None = None
    model_limits: dict[ModelName, LimitsSpec | None] | None = None
    share_prefix_cache: bool | None = None


class ApiKey(BaseModel):
    """A key record. ``digest`` is the HMAC of the secret; the secret itself is never kept."""

    model_config = ConfigDict(extra="ignore")

    id: str
    tenant_id: str
    name: str | None = None
    display: str
    digest: str
    created: int
    expires_at: int | None = None
    revoked_at: int | None = None
    scopes: list[str] = Field(default_factory=list)
    limits: LimitsSpec | None = None
    replaced_by: str | None = None
    tenant_uid: str = ""

    def is_active(self, now: float) -> bool:
        if self.revoked_at is not None and self.revoked_at <= now:
            return False
        return self.expires_at is None or now < self.expires_at

    def public(self, now: float | None = None) -> dict[str, Any]:
        """The record as the admin API shows it: no digest, plus a computed status."""
        now = time.time() if now is None else now
        body = self.model_dump(exclude={"digest", "tenant_uid"})
        if self.revoked_at is not None and self.revoked_at <= now:
            body["status"] = "revoked"
        elif self.expires_at is not None and now >= self.expires_at:
            body["status"] = "expired"
        else:
            body["status"] = "active"
        return body


class KeyCreate(BaseModel):
    """Body of ``POST /admin/v1/tenants/{id}/keys``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    expires_in_seconds: (
        Annotated[int, BeforeValidator(whole_number), Field(ge=1, le=10 * 365 * 86400)] | None
    ) = None
    scopes: list[Scope] = Field(default_factory=lambda: ["inference"], max_length=32)
    limits: LimitsSpec | None = None


def new_key_secret() -> str:
    """A fresh API key secret: 256 bits from ``secrets``."""
    return "sk-" + secrets.token_urlsafe(32)


def display_form(secret: str) -> str:
    return f"{secret[:3]}...{secret[-4:]}"
