"""The score and rerank bodies (engine/server/protocol_score.py) and the arithmetic of
engine/server/serving_score.py, without a server: how pairs are formed, what is refused and
naming which parameter, and the sigmoid and cosine the routes answer with."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from engine.server.protocol import parse_body
from engine.server.protocol_score import RerankRequest, ScoreRequest
from engine.server.serving_score import cosines, sigmoid
from portico.errors import InvalidRequestError


def score(**body: Any) -> ScoreRequest:
    return parse_body(ScoreRequest, json.dumps({"model": "m", **body}).encode())


def rerank(**body: Any) -> RerankRequest:
    return parse_body(RerankRequest, json.dumps({"model": "m", **body}).encode())


def test_pairs_are_one_to_one_one_to_n_or_n_to_n() -> None:
    assert score(text_1="q", text_2="d").pairs() == [(0, 0)]
    assert score(text_1="q", text_2=["a", "b", "c"]).pairs() == [(0, 0), (0, 1), (0, 2)]
    assert score(text_1=["q", "r"], text_2=["a", "b"]).pairs() == [(0, 0), (1, 1)]
    with pytest.raises(InvalidRequestError) as info:
        score(text_1=["q", "r"], text_2=["a", "b", "c"]).pairs()
    assert info.value.param == "text_2"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text_1": "q"}, "text_2"),
        ({"text_1": [], "text_2": "d"}, "text_1"),
        ({"text_1": "q", "text_2": ["d", ""]}, "text_2"),
        ({"text_1": "q", "text_2": "d", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"text_1": "q", "text_2": "d", "top_n": 1}, "top_n"),  # a rerank field, not score's
    ],
)
def test_bad_score_bodies_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        score(**body)
    assert info.value.param == param


def test_rerank_documents_as_strings_or_objects_and_top_n() -> None:
    req = rerank(query="q", documents=["a", {"text": "b"}])
    assert req.texts == ["a", "b"] and req.num_results() == 2 and req.return_documents
    assert rerank(query="q", documents=["a", "b"], top_n=0).num_results() == 2  # vLLM: all
    assert rerank(query="q", documents=["a", "b"], top_n=1).num_results() == 1
    with pytest.raises(InvalidRequestError) as info:
        rerank(query="q", documents=["a"], top_n=2).num_results()
    assert info.value.param == "top_n"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [{"title": "a"}]}, "documents[0]"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ],
)
def test_bad_rerank_bodies_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        rerank(**body)
    assert info.value.param is not None and info.value.param.startswith(param)


def test_sigmoid_and_cosine() -> None:
    assert sigmoid(0.0) == 0.5
    assert sigmoid(2.0) == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert sigmoid(-1000.0) == 0.0 and sigmoid(1000.0) == 1.0  # no overflow
    got = cosines([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], [[2.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    assert got == pytest.approx([1.0, -1 / math.sqrt(2), 0.0])
