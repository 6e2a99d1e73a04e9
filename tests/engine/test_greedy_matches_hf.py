"""Greedy decoding equals Hugging Face transformers token for token on SmolLM2-135M-Instruct.

16 prompts of mixed lengths run together in one batch through the whole engine (scheduler,
paged KV, chunked prefill, sampler); the references come from transformers' own ``generate``,
one unpadded prompt at a time, on the same GGUF weights dequantized to float32. Then again with
prefix caching off, and with a KV pool so small that requests are preempted (recompute and
swap), which must not change a single token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 16

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 5, 8, 13,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "SELECT name, email FROM users WHERE",
    "Water boils at",
    "The three primary colors are",
    "import numpy as np\nimport torch\n\n# Load the dataset and",
    "Le chat est sur la",
    "Q: What is the largest planet in the solar system?\nA:",
    (
        "Photosynthesis is the process by which green plants and some other organisms use "
        "sunlight to synthesize foods from carbon dioxide and water. Photosynthesis in plants "
        "generally involves the green pigment chlorophyll and generates oxygen as a byproduct. "
        "The process takes place mainly in the leaves, where cells contain chloroplasts. "
        "In summary, the two main stages of photosynthesis are"
    ),
    "Hi",
]
CHAT_PROMPTS = [
    "What is 12 times 7?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "List three fruits that are red.",
]


@pytest.fixture(scope="module")
def loaded(smollm2_float32: LoadedModel) -> LoadedModel:
    return smollm2_float32


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    out = [tok.encode(p) for p in PLAIN_PROMPTS]
    for question in CHAT_PROMPTS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def hf_references(smollm2_hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, generated alone (no padding)."""
    model = smollm2_hf
    eos = model.generation_config.eos_token_id
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=eos,
            )
            refs.append(out[0, len(ids) :].tolist())
    return refs


def run_engine(
    loaded: LoadedModel, prompts: list[list[int]], **overrides: Any
) -> tuple[LLMEngine, list[list[int]]]:
    """All prompts in one engine, queued together; greedy tokens in prompt order."""
    # the exact flags: float32 is token for token what transformers produces
    exact = {"dtype": "float32", "gguf_activations": "exact"}
    config = EngineConfig(model="smollm2", device="cpu", **{**exact, **overrides})
    engine = LLMEngine(config, loaded)
    outputs = LLM.from_engine(engine).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    return engine, [o.outputs[0].token_ids for o in outputs]


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not engine.has_unfinished()


def test_prompts_are_varied(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16 and lengths[0] < 5 and lengths[-1] > 60


def test_greedy_batch_matches_transformers(
    loaded: LoadedModel, prompts: list[list[int]], hf_references: list[list[int]]
) -> None:
    engine, tokens = run_engine(loaded, prompts, max_num_batched_tokens=256)
    assert tokens == hf_references
    assert_idle(engine)


def test_greedy_matches_without_prefix_caching(
    loaded: LoadedModel, prompts: list[list[int]], hf_references: list[list[int]]
) -> None:
    engine, tokens = run_engine(loaded, prompts, enable_prefix_caching=False)
    assert tokens == hf_references
    assert engine.stats().prefix_cache_hits == 0
    assert_idle(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_under_preemption(
    loaded: LoadedModel, prompts: list[list[int]], hf_references: list[list[int]], mode: str
) -> None:
    engine, tokens = run_engine(loaded, prompts, num_gpu_blocks_override=16, preemption_mode=mode)
    assert engine.stats().num_preemptions > 0
    assert tokens == hf_references
    assert_idle(engine)


def test_greedy_matches_on_the_gguf_blocks(
    smollm2_gguf: Path, prompts: list[list[int]], hf_references: list[list[int]]
) -> None:
    """quantization "gguf": steps of few rows run on the file's Q4_1/Q8_0 blocks (native
    kernels) and must still give transformers' tokens; at most 4 sequences at a time, so most
    decode steps take the block path."""
    from engine.kernels import cpu

    if not cpu.available():
        pytest.skip("no C compiler for the CPU kernels")
    quantized = load_model(
        ModelSource("smollm2", smollm2_gguf, "gguf"), torch.float32, "cpu", "gguf"
    )
    layer = quantized.model.model.layers[0]
    assert layer.self_attn.qkv_proj.blocks is not None and quantized.model.lm_head_blocks
    engine, tokens = run_engine(quantized, prompts, max_num_seqs=4, quantization="gguf")
    assert tokens == hf_references
    assert_idle(engine)
