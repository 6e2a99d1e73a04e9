"""Speculative decoding on the default model (SmolLM2-135M-Instruct, GGUF, float32 on CPU):
greedy outputs equal to no speculation with each proposer over a copy-heavy batch with
preemption forced, and the model as its own draft accepting every guess."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.sampling_params import SamplingParams
from load.spec_bench import CODE, CODE_CHANGES, PASSAGE, QUESTIONS, chat_prompt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def smollm2(smollm2_float32: LoadedModel) -> LoadedModel:
    return smollm2_float32


def make(loaded: LoadedModel, **kw: object) -> LLM:
    config = EngineConfig(model="smollm2", device="cpu", dtype="float32", **kw)  # type: ignore[arg-type]
    return LLM.from_engine(LLMEngine(config, loaded))


def test_copy_heavy_greedy_equals_no_speculation(smollm2: LoadedModel, smollm2_gguf: Path) -> None:
    plain = make(smollm2, num_gpu_blocks_override=256)
    prompts = [
        chat_prompt(plain, f"{CODE_CHANGES[0]} Output the whole file.\n\n```python\n{CODE}```"),
        chat_prompt(plain, f"{PASSAGE}\n\nQuote the sentence that answers: {QUESTIONS[1]}"),
        chat_prompt(plain, "Why is the sky blue?"),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for spec, k in (
        ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}, 3),
        ({"model": str(smollm2_gguf)}, 2),
    ):
        # Room for the prompts and two blocks more: all start, and growing forces preemption.
        num_blocks = sum(-(-len(p) // 16) for p in prompts) + 2
        llm = make(
            smollm2, num_gpu_blocks_override=num_blocks,
            speculative_config={**spec, "num_speculative_tokens": k, "disable_by_batch_size": None},
        )  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.spec_decode_num_accepted_tokens > 0
        if "model" in spec:  # the model as its own draft: every greedy guess is accepted
            assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
        assert stats.num_free_blocks == stats.num_total_blocks
