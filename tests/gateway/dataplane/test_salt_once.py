"""A request's engine salt is narrowed (a SHA-256 of the tenant's and the client's salts)
once: the prefix-aware router and the body sent to the engine reuse the same value."""

from __future__ import annotations

import json

import pytest

import gateway.relay.usage_relay as usage_relay
from gateway.body.fields import parse_fields
from gateway.identity.cache_salts import narrowed_salt
from gateway.relay.usage_relay import engine_salt, upstream_body

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "user-7"}


def test_client_salt_is_narrowed_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str | None]] = []

    def counting(tenant_salt: str, client_salt: str | None) -> str:
        calls.append((tenant_salt, client_salt))
        return narrowed_salt(tenant_salt, client_salt)

    monkeypatch.setattr(usage_relay, "narrowed_salt", counting)
    raw = json.dumps(BODY).encode()
    fields = parse_fields(raw, "chat")
    routed = engine_salt(fields, "tenant-a")  # what the router hashes the blocks under
    sent = json.loads(upstream_body(raw, fields, "m", "tenant-a", 16, local_engine=True))
    assert routed == sent["cache_salt"] == narrowed_salt("tenant-a", "user-7")
    assert calls == [("tenant-a", "user-7")]
    # another tenant salt (a fallback tier's, say) is narrowed anew, never served stale
    assert engine_salt(fields, "tenant-b") == narrowed_salt("tenant-b", "user-7")
    assert len(calls) == 2


def test_without_a_client_salt_the_tenant_salt_travels_unhashed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(usage_relay, "narrowed_salt", lambda *a: pytest.fail("hashed"))
    body = {k: v for k, v in BODY.items() if k != "cache_salt"}
    raw = json.dumps(body).encode()
    fields = parse_fields(raw, "chat")
    assert engine_salt(fields, "tenant-a") == "tenant-a"
    assert json.loads(upstream_body(raw, fields, "m", "tenant-a"))["cache_salt"] == "tenant-a"
