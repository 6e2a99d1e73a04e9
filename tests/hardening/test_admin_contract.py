"""The admin API's document against its behaviour, case by case (the schemathesis run in
test_openapi_contract.py finds these classes; these tests pin each one down by name)."""

from __future__ import annotations

import httpx
import pytest

from tests.hardening.conftest import HardenedGateway


@pytest.fixture(scope="module")
def admin(hardened_gateway: HardenedGateway) -> httpx.Client:
    return hardened_gateway.admin()


@pytest.fixture(scope="module")
def document(admin: httpx.Client) -> dict:
    r = admin.get("/admin/v1/openapi.json")
    r.raise_for_status()
    return r.json()


@pytest.mark.parametrize(
    "query,param",
    [
        ({"end": "0001-01-01"}, "end"),  # was a 500: 29 days before it is out of range
        ({"start": "0001-01-01"}, "start"),
        ({"end": "0"}, "end"),  # was read as a Unix time: 1970-01-01
        ({"end": "2024-02-30"}, "end"),
        ({"start": "99999-01-01"}, "start"),
        ({"start": "2024-03-01", "end": "2024-01-01"}, "end"),
        ({"start": "1970-01-01", "end": "9999-12-31"}, "end"),  # more than 366 days
    ],
)
def test_usage_dates_out_of_range_are_a_400_naming_the_parameter(
    hardened_gateway: HardenedGateway, admin: httpx.Client, query: dict, param: str
) -> None:
    tenant_id, _ = hardened_gateway.process.create_tenant("standard")
    r = admin.get(f"/admin/v1/tenants/{tenant_id}/usage", params=query)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_whole_numbers_written_as_floats_are_accepted_as_integers(admin: httpx.Client) -> None:
    r = admin.post(
        "/admin/v1/tenants",
        json={"id": "wholes", "name": "w", "overrides": {"requests_per_minute": 5257552.0}},
    )
    assert r.status_code == 201, r.text
    assert r.json()["overrides"]["requests_per_minute"] == 5257552
    r = admin.post("/admin/v1/tenants/wholes/keys", json={"expires_in_seconds": 60.0})
    assert r.status_code == 201, r.text
    r = admin.patch("/admin/v1/tenants/wholes", json={"overrides": {"max_concurrency": 2.5}})
    assert r.status_code == 400 and "max_concurrency" in r.json()["error"]["param"]


def test_a_405_names_every_method_of_the_path(admin: httpx.Client, document: dict) -> None:
    r = admin.post("/admin/v1/tenants/nobody")
    assert r.status_code == 405
    allowed = {m.strip() for m in r.headers["allow"].split(",")}
    documented = {m.upper() for m in document["paths"]["/admin/v1/tenants/{tenant_id}"]}
    assert documented <= allowed and "POST" not in allowed


def test_every_status_the_api_answers_is_documented(
    admin: httpx.Client, document: dict, hardened_gateway: HardenedGateway
) -> None:
    tenants = document["paths"]["/admin/v1/tenants"]["post"]["responses"]
    one = document["paths"]["/admin/v1/tenants/{tenant_id}"]["get"]["responses"]
    assert {"201", "400", "401", "403", "409"} <= set(tenants)
    assert {"200", "401", "404"} <= set(one)
    assert all(
        "422" not in op["responses"] for p in document["paths"].values() for op in p.values()
    )
    # and the behaviour behind each: 401, 404, 409, with OpenAI's error shape
    assert httpx.get(hardened_gateway.url + "/admin/v1/tenants").status_code == 401
    assert admin.get("/admin/v1/tenants/nobody").status_code == 404
    admin.post("/admin/v1/tenants", json={"id": "twice", "name": "t"})
    again = admin.post("/admin/v1/tenants", json={"id": "twice", "name": "t"})
    assert again.status_code == 409 and again.json()["error"]["param"] == "id"
