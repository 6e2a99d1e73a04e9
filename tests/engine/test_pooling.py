"""Embeddings and prompt logprobs read from the prompt's hidden states (engine/pooling.py),
checked against transformers on the tiny random Llama: the same pooling of
``last_hidden_state``, and the log-softmax of the causal LM's logits.

Requests run through the whole engine (scheduler, chunked prefill, paged KV) beside ordinary
generation; an embedding is the same alone and in a batch, and chunking or preemption does not
change it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.pooling_params import PoolingParams, load_pooler_config
from engine.sampling_params import SamplingParams
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [
    [1, 5, 9, 200, 31, 7, 7, 400, 12, 3, 99, 1000, 42, 17, 8, 11, 2, 5, 6, 301],
    [1, 77, 3],
    [9] * 37,
]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32).eval()


def reference(hf_model, ids: list[int], kind: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0)


def embed(engine: LLMEngine, prompts: list[list[int]], pooling: PoolingParams) -> list[list[float]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    for i, ids in enumerate(prompts):
        engine.add_request(f"e{i}", ids, params)
    final = run_all(engine)
    out = []
    for i in range(len(prompts)):
        assert final[f"e{i}"].embedding is not None
        out.append(final[f"e{i}"].embedding)
    return out


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embedding_equals_transformers_pooling(tiny: LoadedModel, hf_model, kind: str) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny)
    got = embed(engine, PROMPTS, PoolingParams(kind))
    for ids, vector in zip(PROMPTS, got, strict=True):
        want = reference(hf_model, ids, kind)
        torch.testing.assert_close(torch.tensor(vector), want, rtol=1e-4, atol=1e-5)
        assert abs(torch.tensor(vector).norm().item() - 1.0) < 1e-5


def test_embedding_same_alone_in_a_batch_and_chunked_beside_generation(
    tiny: LoadedModel,
) -> None:
    pooling = PoolingParams("MEAN")
    alone = [embed(make_engine(tiny), [ids], pooling)[0] for ids in PROMPTS]
    # A small step budget: prompts are prefilled in chunks, next to a running generation.
    engine = make_engine(tiny, max_num_batched_tokens=8, enable_prefix_caching=True)
    engine.add_request("gen", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))
    engine.add_request("warm", PROMPTS[2], SamplingParams(max_tokens=1))  # caches its prefix
    batched = embed(engine, PROMPTS, pooling)
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing left behind


def test_dimensions_cut_then_normalise(tiny: LoadedModel, hf_model) -> None:  # type: ignore[no-untyped-def]
    [vector] = embed(make_engine(tiny), PROMPTS[:1], PoolingParams("LAST", dimensions=16))
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1, :16]
    torch.testing.assert_close(
        torch.tensor(vector), torch.nn.functional.normalize(hidden, dim=0), rtol=1e-4, atol=1e-5
    )


def test_prompt_logprobs_equal_transformers_log_softmax(tiny: LoadedModel, hf_model) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, max_num_batched_tokens=8)  # chunked: rows arrive in pieces
    ids = PROMPTS[0]
    engine.add_request("p", ids, SamplingParams(max_tokens=3, prompt_logprobs=2))
    delivered = []
    while engine.has_unfinished():
        delivered += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    [prompt_logprobs] = delivered  # once, on the first output after the prompt was computed
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    for p, entry in enumerate(prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == ids[p]
        assert entry.logprob == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4)
        top = want[p - 1].topk(2)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()


def test_pooler_config_from_flag_and_sentence_transformers_files(tmp_path: Path) -> None:
    assert load_pooler_config(None, None).params() == PoolingParams("LAST", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True})
    )
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    config = load_pooler_config(tmp_path, None)
    assert config.pooling_type == "MEAN" and config.allows_dimensions(16)
    assert not config.allows_dimensions(20)
    flagged = load_pooler_config(tmp_path, '{"pooling_type": "cls", "normalize": false}')
    assert (flagged.pooling_type, flagged.normalize) == ("CLS", False)
    with pytest.raises(ValueError, match="--pooler-config"):
        load_pooler_config(None, '{"pooling": "x"}')


def test_embeddings_are_unchanged_when_the_engine_preempts(tiny: LoadedModel) -> None:
    pooling = PoolingParams("MEAN")
    alone = [embed(make_engine(tiny), [ids], pooling)[0] for ids in PROMPTS]
    # A pool so small that generations and embeddings preempt each other (recompute).
    engine = make_engine(tiny, num_gpu_blocks_override=6, max_num_batched_tokens=16)
    for i in range(3):
        engine.add_request(f"g{i}", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    squeezed = embed(engine, PROMPTS, pooling)
    assert engine.stats().num_preemptions > 0
    for a, b in zip(alone, squeezed, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)


def test_offline_llm_embed_uses_the_model_pooling(tiny: LoadedModel, hf_model) -> None:  # type: ignore[no-untyped-def]
    from engine.llm import LLM

    llm = LLM.from_engine(make_engine(tiny, pooler_config='{"pooling_type": "MEAN"}'))
    [vector] = llm.embed([PROMPTS[1]])
    torch.testing.assert_close(
        torch.tensor(vector), reference(hf_model, PROMPTS[1], "MEAN"), rtol=1e-4, atol=1e-5
    )
