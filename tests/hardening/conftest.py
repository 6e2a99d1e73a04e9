"""A real gateway for the hardening suites: ``portico serve`` as a subprocess, a supervised fake
engine, a Redis of the module's own (so its counters and slots can be read), and HS256 JWTs.

The suites talk to it over HTTP only, as a client or an attacker would.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import ADMIN_KEY, GatewayProcess, fake_engine_command

JWT_ISSUER = "https://idp.test"
JWT_AUDIENCE = "portico"
MODEL = "fake"


class HardenedGateway:
    """The gateway process, its Redis and the JWT secret, with what the tests read back."""

    def __init__(self, process: GatewayProcess, redis: RedisServer, jwt_secret: bytes) -> None:
        self.process = process
        self.redis = redis
        self.jwt_secret = jwt_secret
        self.url = process.base_url

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )

    def token(self, **claims: Any) -> str:
        """A validly signed JWT; ``claims`` replace (or, as None, drop) the defaults."""
        now = int(time.time())
        body: dict[str, Any] = {
            "iss": JWT_ISSUER,
            "aud": JWT_AUDIENCE,
            "iat": now,
            "exp": now + 600,
            "sub": "user-1",
        }
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}

        # Signed by hand: PyJWT's encoder refuses some of the wrongly typed claims under test.
        def part(obj: Any) -> bytes:
            return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=")

        signing_input = part({"alg": "HS256", "typ": "JWT"}) + b"." + part(body)
        signature = hmac.new(self.jwt_secret, signing_input, hashlib.sha256).digest()
        return (signing_input + b"." + base64.urlsafe_b64encode(signature).rstrip(b"=")).decode()

    def usage_totals(self, tenant_id: str) -> dict[str, int]:
        with self.admin() as admin:
            r = admin.get(f"/admin/v1/tenants/{tenant_id}/usage")
        r.raise_for_status()
        return dict(r.json()["totals"])

    def limiter_state(self, tenant_id: str) -> dict[str, Any]:
        """Every limiter key of the tenant in Redis and what it holds (buckets, slots)."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        try:
            state: dict[str, Any] = {}
            for key in client.scan_iter(match=f"portico:rl:{{{tenant_id}}}:*"):
                kind = client.type(key).decode()
                if kind == "zset":
                    state[key.decode()] = client.zcard(key)
                elif kind == "hash":
                    state[key.decode()] = client.hgetall(key)
                else:
                    state[key.decode()] = client.get(key)
            return state
        finally:
            client.close()

    def live_slots(self, tenant_id: str) -> int:
        return sum(v for k, v in self.limiter_state(tenant_id).items() if "conc" in k)


def start_hardened_gateway(workdir: Path, **config: Any) -> HardenedGateway:
    redis = RedisServer(workdir / "redis")
    redis.start()
    secret = secrets.token_hex(32).encode()  # no whitespace to strip
    (workdir / "jwt.secret").write_bytes(secret)
    process = GatewayProcess(
        workdir,
        {
            "redis": {"url": redis.url},
            "auth": {
                **config.pop("auth", {}),
                "jwt": {
                    "algorithms": ["HS256"],
                    "issuer": JWT_ISSUER,
                    "audience": [JWT_AUDIENCE],
                    "hmac_secret_file": str(workdir / "jwt.secret"),
                },
            },
            "engines": [{"name": MODEL, "replicas": 1, "command": fake_engine_command()}],
            # the suites send thousands of refusals from one address on purpose
            "admission": {
                "abuse": {k: "100000/minute" for k in ("unauthenticated", "failed_auth", "admin")},
                **config.pop("admission", {}),
            },
            **config,
        },
        {},
        {},
    )
    try:
        process.start(timeout=120)
    except Exception:
        redis.stop()
        raise
    return HardenedGateway(process, redis, secret)


@pytest.fixture(scope="module")
def hardened_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HardenedGateway]:
    gw = start_hardened_gateway(tmp_path_factory.mktemp("hardened"))
    yield gw
    gw.process.terminate()
    gw.redis.stop()
