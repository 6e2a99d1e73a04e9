"""``/v1/score`` and ``/v1/rerank`` (and vLLM's ``/rerank``, ``/v2/rerank``) on real engine
processes, checked against transformers on small models made here: a tiny random
``LlamaForSequenceClassification`` (its score head's sigmoid on the pair tokenized as one
sequence) and the session's tiny Llama as an embedding model (the cosine of the last token's
normalised hidden states). The ``openai`` client has no score method: httpx speaks JSON."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_server_process import MODEL_NAME, EngineProcess
from score_oracle import cosine_scores, cross_encoder_scores
from tiny_llama import build_tiny_reranker

pytestmark = pytest.mark.slow

QUERY = "What does a lighthouse keeper do?"
DOCUMENTS = [  # in an order the tiny reranker (seed 3) does not rank them in
    "Tides follow the moon.",
    "Bread rises in a warm kitchen.",
    "The keeper climbs the tower every night to light the lamp for passing ships.",
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reranker(tmp_path_factory.mktemp("tiny-reranker"), seed=3)


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    server = EngineProcess(reranker_dir, tmp_path_factory.mktemp("reranker") / "engine.log")
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.logs()


@pytest.fixture(scope="module")
def cross_client(reranker: EngineProcess) -> Iterator[httpx.Client]:
    with reranker.client() as client:
        yield client


@pytest.fixture(scope="module")
def embed_client(hermes_engine_server: EngineProcess) -> Iterator[httpx.Client]:
    with hermes_engine_server.client() as client:
        yield client


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def test_cross_encoder_score_equals_transformers_sigmoid(
    cross_client: httpx.Client, reranker_dir: Path
) -> None:
    body = {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}
    got = post(cross_client, "/v1/score", body)
    want, num_tokens = cross_encoder_scores(reranker_dir, [(QUERY, d) for d in DOCUMENTS])
    assert got["object"] == "list" and got["model"] == MODEL_NAME
    assert [d["index"] for d in got["data"]] == [0, 1, 2]
    assert {d["object"] for d in got["data"]} == {"score"}
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-4)
    assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == num_tokens
    # N:N pairs the lists in order; a single text_1 against a single text_2 is one pair
    pairs = [(DOCUMENTS[0], DOCUMENTS[1]), (QUERY, DOCUMENTS[2])]
    n_to_n = post(cross_client, "/v1/score", {
        "model": MODEL_NAME, "text_1": [a for a, _ in pairs], "text_2": [b for _, b in pairs],
    })  # fmt: skip
    assert [d["score"] for d in n_to_n["data"]] == pytest.approx(
        cross_encoder_scores(reranker_dir, pairs)[0], abs=1e-4
    )
    one = post(
        cross_client, "/v1/score", {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS[1]}
    )
    assert one["data"][0]["score"] == pytest.approx(want[1], abs=1e-4)


def test_rerank_sorts_by_the_head_score_on_every_path(
    cross_client: httpx.Client, reranker_dir: Path
) -> None:
    want, num_tokens = cross_encoder_scores(reranker_dir, [(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert order != list(range(len(DOCUMENTS)))  # so the sort is proven, not the input order
    body = {"model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS}
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        got = post(cross_client, path, body)
        assert got["model"] == MODEL_NAME and got["usage"] == {"total_tokens": num_tokens}
        assert [r["index"] for r in got["results"]] == order
        for r in got["results"]:
            assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-4)
            assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    objects = [{"text": d} for d in DOCUMENTS]
    top = post(cross_client, "/v1/rerank", {
        "model": MODEL_NAME, "query": QUERY, "documents": objects, "top_n": 2,
        "return_documents": False,
    })  # fmt: skip
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])


def test_embedding_model_scores_the_cosine_of_transformers_hidden_states(
    embed_client: httpx.Client, tiny_llama_dir: Path
) -> None:
    want = cosine_scores(tiny_llama_dir, [(QUERY, d) for d in DOCUMENTS])
    got = post(
        embed_client, "/v1/score", {"model": MODEL_NAME, "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-4)
    ranked = post(
        embed_client, "/v1/rerank", {"model": MODEL_NAME, "query": QUERY, "documents": DOCUMENTS}
    )
    assert [r["index"] for r in ranked["results"]] == sorted(range(3), key=lambda i: -want[i])
    # each text embedded once: the query and the three documents
    embedded = post(
        embed_client, "/v1/embeddings", {"model": MODEL_NAME, "input": [QUERY, *DOCUMENTS]}
    )
    assert ranked["usage"]["total_tokens"] == embedded["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"text_1": QUERY}, "text_2"),
        ("/v1/score", {"text_1": 5, "text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 2}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(
    cross_client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    response = cross_client.post(path, json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error


def test_cross_encoder_refuses_generation_and_embeddings(cross_client: httpx.Client) -> None:
    chat = cross_client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
    )
    embed = cross_client.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"})
    for response in (chat, embed):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "unsupported_endpoint" and "cross-encoder" in error["message"]
    missing = cross_client.post("/v1/score", json={"model": "nope", "text_1": "a", "text_2": "b"})
    assert missing.status_code == 404
