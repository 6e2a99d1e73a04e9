"""Multi-LoRA on the default model (SmolLM2-135M-Instruct, GGUF): PEFT adapters made at test
time on transformers' own load of the GGUF file give, through Portico, the greedy tokens of
the same adapters merged into the weights with peft, token for token, with two adapters and
the base model in one batch. Run on the dense float32 weights and on the GGUF blocks (small
decode batches then run the quantized kernels; the LoRA delta is added on top)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter, merged_greedy

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 8
TEXTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def hf_base(smollm2_hf):  # type: ignore[no-untyped-def]
    return smollm2_hf  # the session's; make_adapter and merged_greedy work on deep copies


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("smol-adapters")
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "all-r8": make_adapter(hf_base, root / "a", rank=8, targets=all_linear, seed=1),
        "qv-r16-rs": make_adapter(
            hf_base, root / "b", rank=16, targets=["q_proj", "v_proj"], seed=2,
            alpha=16.0, use_rslora=True, std=0.1,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def peft_greedy(hf_base, adapters) -> Callable[[str | None, list[int]], list[int]]:  # type: ignore[no-untyped-def]
    """``merged_greedy`` remembered per (adapter, prompt): both quantizations are compared with
    the same PEFT tokens, so each is computed once (a deep copy of the model and a merge)."""
    memo: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def greedy(name: str | None, prompt: list[int]) -> list[int]:
        key = (name, tuple(prompt))
        if key not in memo:
            memo[key] = merged_greedy(hf_base, adapters.get(name or ""), prompt, MAX_TOKENS)
        return memo[key]

    return greedy


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_adapters_on_default_model_equal_peft_merged(
    smollm2_gguf: Path,
    adapters: dict[str, Path],
    peft_greedy: Callable[[str | None, list[int]], list[int]],
    quantization: str,
) -> None:
    loaded = load_model(
        ModelSource("smollm2", smollm2_gguf, "gguf"), torch.float32, "cpu", quantization
    )
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    config = EngineConfig(
        model=str(smollm2_gguf), device="cpu", dtype="float32", quantization=quantization,
        enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory="128MiB",
        lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()),
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    assert engine.lora is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names: list[str | None] = [None, *adapters]
    for name in names:
        for i, prompt in enumerate(prompts):
            engine.add_request(
                f"{name}-{i}", prompt, params, lora_request=engine.lora.get(name or "")
            )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    expected = {name: [peft_greedy(name, p) for p in prompts] for name in names}
    for name in names:
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == expected[name], name
    assert all(expected[name] != expected[None] for name in adapters)  # B is non-zero
