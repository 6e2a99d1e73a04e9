"""Money in the admin API, on every Redis backend: model prices (CRUD, validation, override of
the configured price), money budgets on tenants and keys, spend in the usage API, and the usage
export (CSV and JSON Lines, one row per tenant, key, model and day), admin-only."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from identity_app import admin_headers, assert_openai_error, bearer

from gateway.identity.auth import Identity

A = admin_headers()


def today() -> str:
    return datetime.now(timezone.utc).date().isoformat()


async def test_prices_are_set_read_listed_and_deleted(client: httpx.AsyncClient) -> None:
    assert (await client.get("/admin/v1/prices", headers=A)).json()["data"] == []
    assert_openai_error(await client.get("/admin/v1/prices/gpt-x", headers=A), 404)
    body = {"input": 2.5, "cached_input": 1.25, "output": 10}
    resp = await client.put("/admin/v1/prices/gpt-x", json=body, headers=A)
    assert resp.status_code == 200, resp.text
    expected = {
        "object": "model_price",
        "model": "gpt-x",
        "currency": "usd",
        "per_tokens": 1_000_000,
        "input": 2.5,
        "cached_input": 1.25,
        "output": 10.0,
        "source": "admin",
    }
    assert resp.json() == expected
    assert (await client.get("/admin/v1/prices/gpt-x", headers=A)).json() == expected
    # cached input defaults to the input price
    await client.put("/admin/v1/prices/local", json={"input": 0, "output": 0.5}, headers=A)
    listed = (await client.get("/admin/v1/prices", headers=A)).json()["data"]
    assert [p["model"] for p in listed] == ["gpt-x", "local"]
    assert listed[1]["cached_input"] == 0.0 and listed[1]["output"] == 0.5
    assert (await client.delete("/admin/v1/prices/gpt-x", headers=A)).status_code == 204
    assert_openai_error(await client.get("/admin/v1/prices/gpt-x", headers=A), 404)
    assert_openai_error(await client.delete("/admin/v1/prices/gpt-x", headers=A), 404)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": -1, "output": 1}, "input"),
        ({"input": 1, "output": "2"}, "output"),
        ({"input": 1}, "output"),
        ({"input": 1, "output": 1, "cached_input": -0.5}, "cached_input"),
        ({"input": 1, "output": 1, "currency": "eur"}, "currency"),
        ({"input": 1, "output": 2e6}, "output"),
        ({"input": None, "output": 1}, "input"),
    ],
)
async def test_bad_prices_are_a_400_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, object], param: str
) -> None:
    resp = await client.put("/admin/v1/prices/m", json=body, headers=A)
    err = assert_openai_error(resp, 400)
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "")
    assert_openai_error(await client.get("/admin/v1/prices/m", headers=A), 404)


async def test_an_infinite_price_is_refused(client: httpx.AsyncClient) -> None:
    raw = b'{"input": 1e999, "output": 1}'  # JSON's way to an infinity
    resp = await client.put(
        "/admin/v1/prices/m", content=raw, headers={**A, "content-type": "application/json"}
    )
    assert assert_openai_error(resp, 400)["param"] == "input"


async def test_money_routes_are_for_admins_only(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme")
    tenant_key = bearer((await make_key("acme"))["key"])
    price = {"input": 1, "output": 1}
    for headers, status in (({}, 401), (tenant_key, 403)):
        assert_openai_error(await client.get("/admin/v1/prices", headers=headers), status)
        put = await client.put("/admin/v1/prices/m", json=price, headers=headers)
        assert_openai_error(put, status)
        export = await client.get(
            f"/admin/v1/usage/export?start={today()}&end={today()}", headers=headers
        )
        assert_openai_error(export, status)
    assert_openai_error(await client.get("/admin/v1/prices/m", headers=A), 404)


async def test_budgets_on_tenants_and_keys_reach_the_principal(
    client: httpx.AsyncClient, make_tenant, make_key
) -> None:
    await make_tenant("acme", overrides={"budget_usd": 100})
    key = await make_key("acme", limits={"budget_usd": 2.5, "budget_period": "daily"})
    assert key["limits"]["budget_usd"] == 2.5 and key["limits"]["budget_period"] == "daily"
    me = (await client.get("/v1/whoami", headers=bearer(key["key"]))).json()
    assert me["limits"]["budget_usd"] == 100.0 and me["limits"]["budget_period"] is None
    assert me["key_limits"]["budget_usd"] == 2.5
    assert me["key_limits"]["budget_period"] == "daily"
    bad = await client.patch(
        "/admin/v1/tenants/acme", json={"overrides": {"budget_usd": -1}}, headers=A
    )
    assert "budget_usd" in assert_openai_error(bad, 400)["param"]
    bad = await client.patch(
        "/admin/v1/tenants/acme", json={"overrides": {"budget_period": "hourly"}}, headers=A
    )
    assert "budget_period" in assert_openai_error(bad, 400)["param"]


async def _record_two_days(identity: Identity, key1: str, key2: str) -> tuple[str, str]:
    ledger = identity.store.ledger
    day1 = datetime.now(timezone.utc).date()
    day0 = (day1 - timedelta(days=1)).isoformat()
    day1s = day1.isoformat()
    await ledger.record_usage(
        "acme", "m1", 100, 10, cached_tokens=40, spend_micro_usd=1500, key_id=key1, day=day0
    )
    for _ in range(2):
        await ledger.record_usage(
            "acme", "m1", 50, 5, cached_tokens=0, spend_micro_usd=250, key_id=key1, day=day1s
        )
    await ledger.record_usage("acme", "m1", 7, 3, spend_micro_usd=1_000_001, key_id=key2, day=day1s)
    await ledger.record_usage("acme", "m2", 9, 1, spend_micro_usd=9, day=day1s)  # a JWT caller
    await ledger.record_usage("beta", "m2", 1, 1, spend_micro_usd=2, key_id="key-b", day=day1s)
    return day0, day1s


async def test_usage_api_shows_spend_per_key_and_model(
    client: httpx.AsyncClient, identity: Identity, make_tenant
) -> None:
    await make_tenant("acme")
    await make_tenant("beta")
    day0, day1 = await _record_two_days(identity, "key-1", "key-2")
    usage = (
        await client.get(f"/admin/v1/tenants/acme/usage?start={day0}&end={day1}", headers=A)
    ).json()
    assert usage["totals"]["spend_micro_usd"] == 1500 + 500 + 1_000_001 + 9
    assert usage["totals"]["spend_usd"] == pytest.approx(1.00201)
    assert usage["totals"]["cached_tokens"] == 40
    assert usage["models"]["m1"]["spend_micro_usd"] == 1500 + 500 + 1_000_001
    assert usage["keys"]["key-1"]["requests"] == 3
    assert usage["keys"]["key-1"]["models"]["m1"]["prompt_tokens"] == 200
    assert usage["keys"]["key-2"]["spend_micro_usd"] == 1_000_001
    assert set(usage["keys"]) == {"key-1", "key-2"}  # the JWT caller has no key
    assert [d["spend_micro_usd"] for d in usage["days"]] == [1500, 500 + 1_000_001 + 9]
    assert usage["days"][1]["keys"]["key-1"]["requests"] == 2


async def test_export_has_one_row_per_tenant_key_model_and_day(
    client: httpx.AsyncClient, identity: Identity, make_tenant
) -> None:
    await make_tenant("acme")
    await make_tenant("beta")
    day0, day1 = await _record_two_days(identity, "key-1", "key-2")
    url = f"/admin/v1/usage/export?start={day0}&end={day1}"
    resp = await client.get(url + "&format=jsonl", headers=A)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in resp.text.splitlines()]
    expected = [
        (day0, "acme", "key-1", "m1", 1, 100, 40, 10, 1500),
        (day1, "acme", "key-1", "m1", 2, 100, 0, 10, 500),
        (day1, "acme", "key-2", "m1", 1, 7, 0, 3, 1_000_001),
        (day1, "acme", None, "m2", 1, 9, 0, 1, 9),
        (day1, "beta", "key-b", "m2", 1, 1, 0, 1, 2),
    ]
    columns = (
        "date",
        "tenant_id",
        "key_id",
        "model",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "spend_micro_usd",
    )
    assert [tuple(r[c] for c in columns) for r in rows] == expected
    assert rows[2]["spend_usd"] == 1.000001

    resp = await client.get(url + "&format=csv", headers=A)
    assert resp.headers["content-type"].startswith("text/csv")
    assert f'filename="usage-{day0}-{day1}.csv"' in resp.headers["content-disposition"]
    table = list(csv.DictReader(io.StringIO(resp.text)))
    assert [r["spend_usd"] for r in table] == [
        "0.001500",
        "0.000500",
        "1.000001",
        "0.000009",
        "0.000002",
    ]
    assert [r["key_id"] for r in table] == ["key-1", "key-1", "key-2", "", "key-b"]
    assert (await client.get(url, headers=A)).text == resp.text  # csv is the default

    only = await client.get(url + "&format=jsonl&tenant_id=beta", headers=A)
    assert [json.loads(line)["tenant_id"] for line in only.text.splitlines()] == ["beta"]
    empty = await client.get("/admin/v1/usage/export?start=2020-01-01&end=2020-01-02", headers=A)
    assert empty.text.splitlines() == [",".join((*columns[:8], "spend_usd", "spend_micro_usd"))]


@pytest.mark.parametrize(
    "query,status,param",
    [
        ("start=2024-01-01&end=2024-01-02&format=xml", 400, "format"),
        ("end=2024-01-02", 400, "start"),
        ("start=2024-01-01", 400, "end"),
        ("start=2024-13-01&end=2024-12-02", 400, "start"),
        ("start=yesterday&end=2024-12-02", 400, "start"),
        ("start=2024-03-01&end=2024-01-01", 400, "end"),
        ("start=2020-01-01&end=2024-01-01", 400, "end"),  # more than 366 days
        ("start=2024-01-01&end=2024-01-02&tenant_id=Bad!", 400, "tenant_id"),
        ("start=2024-01-01&end=2024-01-02&tenant_id=nobody", 404, None),
    ],
)
async def test_bad_export_parameters_are_refused(
    client: httpx.AsyncClient, query: str, status: int, param: str | None
) -> None:
    err = assert_openai_error(
        await client.get(f"/admin/v1/usage/export?{query}", headers=A), status
    )
    if param is not None:
        assert param in (err["param"] or ""), err


async def test_a_model_name_with_a_slash_has_a_price(client: httpx.AsyncClient) -> None:
    """Remote models may be named like their provider's (``openai/gpt-4o-mini``)."""
    resp = await client.put(
        "/admin/v1/prices/openai/gpt-4o-mini", json={"input": 0.15, "output": 0.6}, headers=A
    )
    assert resp.status_code == 200 and resp.json()["model"] == "openai/gpt-4o-mini"
    got = await client.get("/admin/v1/prices/openai/gpt-4o-mini", headers=A)
    assert got.json()["output"] == 0.6
    assert (
        await client.delete("/admin/v1/prices/openai/gpt-4o-mini", headers=A)
    ).status_code == 204
    assert_openai_error(
        await client.put("/admin/v1/prices/a%7Cb", json={"input": 1, "output": 1}, headers=A), 400
    )
