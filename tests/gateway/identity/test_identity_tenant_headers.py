"""The plan fields the engine hop's tenant headers are made of (``weight``, ``priority_class``,
``kv_share``): validated when the plans file is read, and carried on every principal, an API
key's and a tenant JWT's alike, over a real (embedded) Redis."""

from __future__ import annotations

import time
from pathlib import Path

import jwt
import pytest

from gateway.identity.auth import AuthSettings, open_identity
from gateway.identity.jwt_auth import JWTSettings
from gateway.identity.plans import load_plans
from gateway.identity.principal import EngineShare
from gateway.identity.records import KeyCreate, TenantCreate
from gateway.relay.engine_hop import engine_hop_headers
from gateway.store import StoreSettings, open_shared_redis

HMAC_SECRET = "s" * 48
PLANS = """
default_plan: small
plans:
  small: {requests_per_minute: 10}
  offline: {weight: 3, priority_class: batch, kv_share: 0.25, max_running: 4}
"""


def _plans_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plans.yaml"
    path.write_text(text)
    return path


def test_plan_fields_default_to_the_engines_defaults(tmp_path: Path) -> None:
    plans = load_plans(_plans_file(tmp_path, PLANS))
    assert plans["small"].engine_share() == EngineShare()
    assert plans["offline"].engine_share() == EngineShare(3.0, "batch", 0.25, 4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weight", 0),
        ("weight", -1.5),
        ("weight", 2e6),
        ("kv_share", 0),
        ("kv_share", 1.5),
        ("priority_class", "urgent"),
        ("weight", "heavy"),
        ("max_running", 0),
        ("max_running", -2),
        ("max_running", 1.5),
    ],
)
def test_bad_plan_fields_are_refused_naming_the_field(
    tmp_path: Path, field: str, value: object
) -> None:
    text = f"plans:\n  p: {{{field}: {value!r}}}\n".replace("'", '"')
    with pytest.raises(ValueError, match=field):
        load_plans(_plans_file(tmp_path, text))


async def test_key_and_jwt_principals_carry_the_plans_share(tmp_path: Path) -> None:
    env = {"PORTICO_ADMIN_KEY": "adm-" + "k" * 40, "PORTICO_JWT_HMAC_SECRET": HMAC_SECRET}
    store = StoreSettings(
        url=None, data_dir=tmp_path / "data", plans_file=_plans_file(tmp_path, PLANS)
    )
    auth = AuthSettings(
        jwt=JWTSettings(issuer="https://idp", audience=["portico"], algorithms=["HS256"])
    )
    redis = await open_shared_redis(store, env)
    identity = open_identity(redis.client, store, auth, env)
    try:
        await identity.store.create_tenant(TenantCreate(id="jobs", name="Jobs", plan="offline"))
        _, secret = await identity.store.create_key("jobs", KeyCreate())
        by_key = await identity.authenticator.resolve(f"Bearer {secret}")
        now = int(time.time())
        token = jwt.encode(
            {"iss": "https://idp", "aud": "portico", "sub": "bob", "tenant": "jobs",
             "iat": now, "exp": now + 300},
            HMAC_SECRET,
            algorithm="HS256",
        )  # fmt: skip
        by_jwt = await identity.authenticator.resolve(f"Bearer {token}")
    finally:
        await identity.aclose()
        await redis.aclose()
    for principal in (by_key, by_jwt):
        assert principal.tenant_id == "jobs"
        assert principal.share == EngineShare(3.0, "batch", 0.25, 4)
    assert by_jwt.subject == "bob" and by_key.key_id is not None
    assert engine_hop_headers(by_jwt) == {
        "x-portico-tenant": "jobs",
        "x-portico-tenant-weight": "3.0",
        "x-portico-priority-class": "batch",
        "x-portico-kv-share": "0.25",
        "x-portico-max-running": "4",
    }
