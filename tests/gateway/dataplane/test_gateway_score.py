"""``/v1/score`` and ``/v1/rerank`` through a real ``portico serve`` with tenant keys, real
Redis and three real tiny engines: a cross-encoder (``rerank``), the tiny Llama as an embedding
model (``tiny``) and the tiny Llama started ``--task generate`` (``gen``). Scores equal
transformers'; each request is charged exactly the engine's token count (not the gateway's
reservation); the plan's models, bad bodies and a generation-only model are refused in OpenAI's
shape, and nothing is left held. The ``openai`` client has no score method: httpx it is."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from score_oracle import cosine_scores, cross_encoder_scores
from tiny_llama import build_tiny_reranker

from tests.gateway.dataplane.harness import GatewayProcess, live_slots, tiny_engine, wait_until

pytestmark = pytest.mark.slow

ROUTING = {"tiers": [{"name": "small", "model": "tiny"}]}
PLANS = {"plans": {"metered": {"monthly_token_budget": 10**9, "tokens_per_minute": 10**6}}}
QUERY = "What does a lighthouse keeper do?"
DOCUMENTS = [
    "Tides follow the moon.",
    "Bread rises in a warm kitchen.",
    "The keeper climbs the tower every night to light the lamp for passing ships.",
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reranker(tmp_path_factory.mktemp("tiny-reranker"), seed=3)


@pytest.fixture(scope="module")
def gateway(
    module_tmp: Path, redis_server: Any, tiny_llama_dir: Path, reranker_dir: Path
) -> Iterator[GatewayProcess]:
    plans = module_tmp / "plans.yaml"
    plans.write_text(yaml.safe_dump(PLANS))
    generate_only = tiny_engine(tiny_llama_dir, "gen")
    generate_only["args"] += ["--task", "generate"]
    engines = [
        tiny_engine(tiny_llama_dir, "tiny"),
        tiny_engine(reranker_dir, "rerank"),
        generate_only,
    ]
    gw = GatewayProcess(
        module_tmp,
        {"redis": {"url": redis_server.url, "plans_file": str(plans)}, "engines": engines},
        ROUTING,
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


class Tenant:
    """A fresh tenant with its key, and what the gateway has charged it (the monthly token
    budget's counter in Redis, written when a request settles, before its slot is released:
    so once :func:`released`, the charge is final)."""

    def __init__(self, gw: GatewayProcess, redis_url: str, **fields: Any) -> None:
        self.gw = gw
        self.redis_url = redis_url
        self.id, self.key = gw.create_tenant("metered", **fields)
        month = time.strftime("%Y-%m", time.gmtime())
        self.budget_key = f"portico:budget:{{{self.id}}}:t:{month}"

    def charged(self) -> int:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.get(self.budget_key) or 0)
        finally:
            client.close()

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            self.gw.base_url + path,
            headers={"authorization": f"Bearer {self.key}"},
            json=body,
            timeout=120,
        )


def released(redis_url: str, tenant: Tenant) -> bool:
    """The tenant holds no concurrency slot (an answer relayed from the engine releases its
    slot after the response, settling first: a charge, had there been one, is in by then)."""
    return wait_until(lambda: live_slots(redis_url, tenant.id) == 0, timeout=30)


def reserved(response: httpx.Response) -> int:
    """Tokens admission reserved for the request (OpenAI's rate-limit headers)."""
    limit = int(response.headers["x-ratelimit-limit-tokens"])
    return limit - int(response.headers["x-ratelimit-remaining-tokens"])


def test_cross_encoder_rerank_through_the_gateway_is_charged_the_engine_count(
    gateway: GatewayProcess, redis_server: Any, reranker_dir: Path
) -> None:
    tenant = Tenant(gateway, redis_server.url)
    want, num_tokens = cross_encoder_scores(reranker_dir, [(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    for number, path in enumerate(("/v1/rerank", "/rerank", "/v2/rerank"), start=1):
        response = tenant.post(path, body)
        assert response.status_code == 200, response.text
        got = response.json()
        assert [r["index"] for r in got["results"]] == order[:2]
        for r in got["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
        assert got["usage"] == {"total_tokens": num_tokens}
        assert released(redis_server.url, tenant)
        assert tenant.charged() == number * num_tokens
    score = tenant.post("/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS})
    assert score.status_code == 200, score.text
    assert [d["score"] for d in score.json()["data"]] == pytest.approx(want, abs=1e-4)
    assert released(redis_server.url, tenant) and tenant.charged() == 4 * num_tokens


def test_embedding_model_score_is_the_cosine_and_settles_below_the_reservation(
    gateway: GatewayProcess, redis_server: Any, tiny_llama_dir: Path
) -> None:
    tenant = Tenant(gateway, redis_server.url)
    response = tenant.post("/v1/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    got = response.json()
    want = cosine_scores(tiny_llama_dir, [(QUERY, d) for d in DOCUMENTS])
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-4)
    used = got["usage"]["prompt_tokens"]
    # admission reserved the query once per pair; the engine embedded it once: the charge is
    # the engine's count, settled after the answer
    assert reserved(response) > used > 0
    assert released(redis_server.url, tenant) and tenant.charged() == used


def test_plan_authorises_the_model(gateway: GatewayProcess, redis_server: Any) -> None:
    tenant = Tenant(gateway, redis_server.url, allowed_models=["tiny"])
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}
    response = tenant.post("/v1/rerank", body)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "model_not_allowed"
    stranger = httpx.post(
        gateway.base_url + "/v1/rerank",
        headers={"authorization": "Bearer sk-not-a-key"},
        json=body,
        timeout=30,
    )
    assert stranger.status_code == 401
    assert released(redis_server.url, tenant) and tenant.charged() == 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"model": "rerank", "text_1": QUERY}, "text_2"),
        ("/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": 7}, "text_2"),
        ("/v1/rerank", {"model": "rerank", "query": QUERY, "documents": []}, "documents"),
        (
            "/v1/rerank",
            {"model": "rerank", "query": QUERY, "documents": ["a"], "top_n": 3},
            "top_n",
        ),
        ("/v2/rerank", {"model": "rerank", "documents": ["a"]}, "query"),
        # the engine's own check, relayed: an unknown field
        ("/v1/rerank", {"model": "rerank", "query": QUERY, "documents": ["a"], "x": 1}, "x"),
    ],
)
def test_bad_bodies_are_400_and_leave_nothing_held(
    gateway: GatewayProcess, redis_server: Any, path: str, body: dict[str, Any], param: str
) -> None:
    tenant = Tenant(gateway, redis_server.url)
    response = tenant.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert released(redis_server.url, tenant) and tenant.charged() == 0


def test_generation_only_model_refuses_score_and_rerank(
    gateway: GatewayProcess, redis_server: Any
) -> None:
    tenant = Tenant(gateway, redis_server.url)
    for path, body in (
        ("/v1/score", {"model": "gen", "text_1": QUERY, "text_2": DOCUMENTS}),
        ("/v1/rerank", {"model": "gen", "query": QUERY, "documents": DOCUMENTS}),
    ):
        response = tenant.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_endpoint" and "--task generate" in error["message"]
    assert released(redis_server.url, tenant) and tenant.charged() == 0
