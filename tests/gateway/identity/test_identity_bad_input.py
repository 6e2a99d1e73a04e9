"""Bad input on every admin endpoint: 400 (malformed JSON, wrong types, unknown fields),
404 (unknown tenant or key), 413 (oversized body), all in OpenAI's error shape, and nothing
written to Redis by a refused request."""

from __future__ import annotations

import httpx
import pytest
from identity_app import MAX_BODY_BYTES, admin_headers, assert_openai_error

from gateway.store import StoreSettings

A = admin_headers()
JSON_A = {**A, "Content-Type": "application/json"}
KEY_ID = "key-0123456789abcdef"

# (method, path, a body with a wrong type, a body with an unknown field)
BODY_ENDPOINTS = [
    ("POST", "/admin/v1/tenants", {"id": "x", "name": 5}, {"id": "x", "name": "x", "colour": 1}),
    ("PATCH", "/admin/v1/tenants/acme", {"disabled": "yes"}, {"nmae": "typo"}),
    ("POST", "/admin/v1/tenants/acme/keys", {"expires_in_seconds": "60"}, {"scope": ["x"]}),
    ("POST", "/admin/v1/tenants/acme/keys/{key}/rotate", {"grace_seconds": 1.5}, {"grace": 10}),
]


@pytest.fixture
def store_settings(redis_url: str, tmp_path) -> StoreSettings:
    """Input validation does not depend on the backend: the session's redis-server only."""
    return StoreSettings(url=redis_url, data_dir=tmp_path / "data")


@pytest.fixture
async def acme_key(make_tenant, make_key) -> str:
    await make_tenant("acme")
    return (await make_key("acme"))["id"]


async def _snapshot(identity) -> dict[bytes, bytes]:
    keys = sorted(await identity.redis.keys("portico:*"))
    return {k: await identity.redis.dump(k) for k in keys}


@pytest.mark.parametrize("method,path,wrong_type,unknown_field", BODY_ENDPOINTS)
async def test_bad_bodies_are_400_and_change_nothing(
    client: httpx.AsyncClient,
    identity,
    acme_key: str,
    method: str,
    path: str,
    wrong_type: dict,
    unknown_field: dict,
) -> None:
    path = path.format(key=acme_key)
    before = await _snapshot(identity)

    resp = await client.request(method, path, headers=JSON_A, content=b'{"name": "x",')
    err = assert_openai_error(resp, 400)
    assert err["type"] == "invalid_request_error"

    resp = await client.request(method, path, headers=JSON_A, content=b"[1, 2]")
    assert_openai_error(resp, 400)

    resp = await client.request(method, path, headers=A, json=wrong_type)
    err = assert_openai_error(resp, 400)
    assert err["param"] == next(iter(wrong_type if len(wrong_type) == 1 else ["name"]))

    resp = await client.request(method, path, headers=A, json=unknown_field)
    err = assert_openai_error(resp, 400)
    assert "Unrecognized request argument" in err["message"]

    assert await _snapshot(identity) == before


@pytest.mark.parametrize(
    "field,value",
    [
        ("overrides", {"requests_per_minute": -1}),
        ("overrides", {"tokens_per_minute": True}),
        ("allowed_models", "smollm2-135m"),
        ("allowed_models", ["has space"]),
        ("share_prefix_cache", 1),
        ("id", "Upper Case"),
        ("name", ""),
    ],
)
async def test_invalid_tenant_fields_are_400_naming_the_field(
    client: httpx.AsyncClient, field: str, value: object
) -> None:
    body = {"id": "acme", "name": "Acme", field: value}
    err = assert_openai_error(await client.post("/admin/v1/tenants", headers=A, json=body), 400)
    assert err["param"].split(".")[0].split("[")[0] == field


@pytest.mark.parametrize(
    "body",
    [
        {"expires_in_seconds": 0},
        {"scopes": "inference"},
        {"scopes": ["Bad Scope"]},
        {"limits": {"requests_per_minute": "5"}},
        {"name": ""},
    ],
)
async def test_invalid_key_fields_are_400(
    client: httpx.AsyncClient, acme_key: str, body: dict
) -> None:
    resp = await client.post("/admin/v1/tenants/acme/keys", headers=A, json=body)
    assert_openai_error(resp, 400)


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/admin/v1/tenants/nope", None),
        ("PATCH", "/admin/v1/tenants/nope", {"name": "x"}),
        ("DELETE", "/admin/v1/tenants/nope", None),
        ("POST", "/admin/v1/tenants/nope/keys", {}),
        ("GET", "/admin/v1/tenants/nope/keys", None),
        ("GET", "/admin/v1/tenants/nope/usage", None),
        ("GET", f"/admin/v1/tenants/acme/keys/{KEY_ID}", None),
        ("POST", f"/admin/v1/tenants/acme/keys/{KEY_ID}/revoke", None),
        ("POST", f"/admin/v1/tenants/acme/keys/{KEY_ID}/rotate", None),
    ],
)
async def test_unknown_tenant_or_key_is_404(
    client: httpx.AsyncClient, acme_key: str, method: str, path: str, body: dict | None
) -> None:
    resp = await client.request(method, path, headers=A, json=body)
    assert_openai_error(resp, 404)


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/admin/v1/tenants"),
        ("PATCH", "/admin/v1/tenants/acme"),
        ("POST", "/admin/v1/tenants/acme/keys"),
        ("POST", "/admin/v1/tenants/acme/keys/{key}/rotate"),
    ],
)
async def test_oversized_body_is_413(
    client: httpx.AsyncClient, identity, acme_key: str, method: str, path: str
) -> None:
    before = await _snapshot(identity)
    huge = b'{"name": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    resp = await client.request(method, path.format(key=acme_key), headers=JSON_A, content=huge)
    err = assert_openai_error(resp, 413)
    assert err["code"] == "request_too_large"

    async def chunks():  # no Content-Length: the limit must still hold
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b" " * 1024

    resp = await client.request(method, path.format(key=acme_key), headers=JSON_A, content=chunks())
    assert_openai_error(resp, 413)
    assert await _snapshot(identity) == before


async def test_malformed_path_ids_are_refused(client: httpx.AsyncClient, acme_key: str) -> None:
    resp = await client.get("/admin/v1/tenants/acme/keys/not-a-key-id", headers=A)
    assert resp.status_code in (400, 404)
    assert_openai_error(resp, resp.status_code)
    resp = await client.get("/admin/v1/tenants/ACME", headers=A)
    assert_openai_error(resp, resp.status_code)
    resp = await client.get("/admin/v1/tenants/acme/usage?start=yesterday", headers=A)
    assert assert_openai_error(resp, 400)["param"] == "start"
