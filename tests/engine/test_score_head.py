"""A cross-encoder (``LlamaForSequenceClassification``, ``num_labels`` = 1) loaded from its
Hugging Face folder and run through the whole engine: the score head's logit of a pair equals
transformers' ``logits`` on the same ids, alone, batched, chunked beside generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_llama import build_tiny_reranker

from engine.model_config import ModelConfig
from engine.model_loader import LoadedModel, load_model
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAIRS = [
    ("What is a lighthouse?", "A tower with a light that guides ships."),
    ("What is a lighthouse?", "Bread is baked in an oven."),
    ("Who keeps it?", "The keeper climbs the stairs every night to light the lamp."),
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reranker(tmp_path_factory.mktemp("tiny-reranker"))


@pytest.fixture(scope="module")
def qwen2_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 reranker as they are published: q/k/v biases, no tied embedding."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-reranker")
    return build_tiny_reranker(folder, seed=1, architecture="Qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path) -> LoadedModel:
    return load_model(ModelSource("rerank", reranker_dir, "hf"), torch.float32, "cpu")


def hf_logits(folder: Path, ids: list[list[int]]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([row])).logits[0, 0].item() for row in ids]


def pair_ids(loaded: LoadedModel) -> list[list[int]]:
    return [list(loaded.tokenizer(q, d)["input_ids"]) for q, d in PAIRS]


def test_loader_reads_the_sequence_classification_checkpoint(reranker: LoadedModel) -> None:
    assert reranker.config.architecture == "LlamaForSequenceClassification"
    assert reranker.config.num_labels == 1 and reranker.model.lm_head is None
    assert reranker.model.score is not None


def test_score_head_logits_equal_transformers(reranker: LoadedModel, reranker_dir: Path) -> None:
    ids = pair_ids(reranker)
    want = hf_logits(reranker_dir, ids)
    # chunked prefill beside a generation on the same engine
    engine = make_engine(reranker, max_num_batched_tokens=8)
    engine.add_request("gen", ids[0], SamplingParams(max_tokens=5, ignore_eos=True))
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(
        "LAST", normalize=False, score_head=True))  # fmt: skip
    for i, row in enumerate(ids):
        engine.add_request(f"s{i}", row, params)
    final = run_all(engine)
    got = [final[f"s{i}"].embedding for i in range(len(ids))]
    assert all(g is not None and len(g) == 1 for g in got)
    assert [g[0] for g in got if g] == pytest.approx(want, abs=1e-4)
    assert len(set(round(w, 3) for w in want)) == len(want)  # the pairs score differently
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_qwen2_reranker_with_biases_and_an_untied_embedding_equals_transformers(
    qwen2_reranker_dir: Path,
) -> None:
    loaded = load_model(ModelSource("qwen2", qwen2_reranker_dir, "hf"), torch.float32, "cpu")
    assert loaded.config.qkv_bias and not loaded.config.tie_word_embeddings
    assert loaded.model.lm_head is None  # a cross-encoder has none: the score head instead
    ids = pair_ids(loaded)
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(
        "LAST", normalize=False, score_head=True))  # fmt: skip
    for i, row in enumerate(ids):
        engine.add_request(f"s{i}", row, params)
    final = run_all(engine)
    got = [(final[f"s{i}"].embedding or [])[0] for i in range(len(ids))]
    assert got == pytest.approx(hf_logits(qwen2_reranker_dir, ids), abs=1e-4)


def test_multi_label_classifier_is_refused_by_name(reranker_dir: Path) -> None:
    raw = json.loads((reranker_dir / "config.json").read_text())
    raw["id2label"] = {"0": "no", "1": "yes"}
    with pytest.raises(ValueError, match="num_labels=2"):
        ModelConfig.from_hf(raw)


def test_score_activation_follows_the_sentence_transformers_config(reranker_dir: Path) -> None:
    raw = json.loads((reranker_dir / "config.json").read_text())
    assert ModelConfig.from_hf(raw).score_activation == "sigmoid"  # vLLM's default, 1 label
    identity = {"activation_fn": "torch.nn.modules.linear.Identity"}
    assert ModelConfig.from_hf({**raw, "sentence_transformers": identity}).score_activation == (
        "identity"
    )
    older = {**raw, "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}
    assert ModelConfig.from_hf(older).score_activation == "sigmoid"
    with pytest.raises(ValueError, match="Tanh"):
        ModelConfig.from_hf({**raw, "sentence_transformers": {"activation_fn": "torch.nn.Tanh"}})
