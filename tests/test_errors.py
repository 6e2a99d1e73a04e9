"""The one error shape: validation errors, HTTP errors and oversized bodies, through FastAPI."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from portico.errors import NotFoundError
from portico.http_errors import BodySizeLimitMiddleware, install_error_handlers


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=1024)

    @app.post("/typed")
    async def typed(body: Body) -> dict[str, int]:
        return {"n": body.n}

    @app.get("/missing")
    async def missing() -> None:
        raise NotFoundError("The model 'x' does not exist.", param="model")

    return app


@pytest.fixture
async def client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=make_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


def assert_shape(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_schema_errors_are_400_never_422(client: httpx.AsyncClient) -> None:
    err = assert_shape(await client.post("/typed", json={"n": "many"}), 400)
    assert err["param"] == "n" and err["type"] == "invalid_request_error"
    err = assert_shape(await client.post("/typed", json={"n": 1, "x": 2}), 400)
    assert "x" in str(err["message"])
    bad_json = await client.post(
        "/typed", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "JSON" in str(assert_shape(bad_json, 400)["message"])


async def test_api_error_and_unknown_route(client: httpx.AsyncClient) -> None:
    err = assert_shape(await client.get("/missing"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert_shape(await client.get("/nowhere"), 404)


async def test_oversized_body_is_413_with_or_without_content_length(
    client: httpx.AsyncClient,
) -> None:
    big = b'{"n": 1, "pad": "' + b"x" * 4096 + b'"}'
    err = assert_shape(await client.post("/typed", content=big), 413)
    assert err["code"] == "request_too_large"

    async def chunks():  # no Content-Length: the limit is counted as the body streams in
        for i in range(0, len(big), 512):
            yield big[i : i + 512]

    err = assert_shape(await client.post("/typed", content=chunks()), 413)
    assert err["code"] == "request_too_large"
