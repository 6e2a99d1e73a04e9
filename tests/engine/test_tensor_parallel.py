"""Tensor parallelism: real worker processes over gloo on the CPU.

The proof is greedy equality in float32: the same tokens at TP=2 (tiny Llama, 4 heads / 2 KV
heads) and TP=3 (SmolLM2-135M, 9 / 3) as at TP=1. The shards themselves (weights, GGUF blocks)
are checked against the whole model without processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.sharding import _input_blocks, check_divisible, shard_config
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models.block_linear import GGUFBlocks
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_PROMPTS = [
    list(range(5, 45)),  # longer than the step budget below: a chunked prefill
    [1, 2, 3, 4, 5],
    [300, 301, 302, 303, 304, 305, 306, 307, 308],
    list(range(5, 25)),  # shares a cached prefix with the first prompt
]


def greedy_tokens(
    config: EngineConfig, prompts: list[list[int]] | list[str], max_tokens: int
) -> tuple[dict[str, list[int]], EngineStats]:
    """Run ``prompts`` (token ids, or text for the engine's tokenizer) greedily to the end;
    each request's output tokens. Closes the engine (and stops its workers)."""
    engine = LLMEngine.from_config(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            engine.add_request(str(i), ids, params)
        final: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.outputs[0].token_ids
        return final, engine.stats()
    finally:
        engine.close()


def tiny_config(model: Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": str(model), "device": "cpu", "dtype": "float32",
        "num_gpu_blocks_override": 12, "block_size": 8, "max_num_batched_tokens": 32,
        "preemption_mode": "swap", "swap_space": 0.01,
    }  # fmt: skip
    fields.update(overrides)
    return EngineConfig(**fields)


def test_tp2_greedy_output_equals_tp1_on_tiny_llama(tiny_llama_dir: Path) -> None:
    """Chunked prefill, a cached prefix, and a pool small enough that requests are swapped
    out and back in (the swaps are part of the broadcast plan): every token as at TP=1."""
    single, _ = greedy_tokens(tiny_config(tiny_llama_dir), TINY_PROMPTS, 24)
    split, stats = greedy_tokens(
        tiny_config(tiny_llama_dir, tensor_parallel_size=2), TINY_PROMPTS, 24
    )
    assert split == single
    assert all(len(tokens) == 24 for tokens in split.values())
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_tp2_on_an_int8_kv_cache_equals_tp1(tiny_llama_dir: Path) -> None:
    """Each rank keeps its KV heads' int8 rows with their scales: the same tokens as one rank
    with the same cache, through chunked prefill, a cached prefix and swaps."""
    single, _ = greedy_tokens(tiny_config(tiny_llama_dir, kv_cache_dtype="int8"), TINY_PROMPTS, 24)
    split, stats = greedy_tokens(
        tiny_config(tiny_llama_dir, kv_cache_dtype="int8", tensor_parallel_size=2),
        TINY_PROMPTS,
        24,
    )
    assert split == single
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_tp_refuses_heads_it_cannot_split_and_leaves_no_worker(tiny_llama_dir: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(
        ValueError, match="--tensor-parallel-size 3 must divide the model's attention heads"
    ):
        LLMEngine.from_config(tiny_config(tiny_llama_dir, tensor_parallel_size=3))
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_tp_with_lora_is_refused() -> None:
    with pytest.raises(
        ValueError, match="--enable-lora is not supported with --tensor-parallel-size"
    ):
        EngineConfig(tensor_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def _cfg(heads: int, kv_heads: int, inter: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=inter,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=16, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=1e4,
    )  # fmt: skip


def test_shard_config_divides_heads_kv_heads_and_mlp() -> None:
    local = shard_config(_cfg(9, 3, 1536), 3)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (
        3, 1, 512,
    )  # fmt: skip
    with pytest.raises(ValueError, match="KV heads \\(2\\)"):
        check_divisible(_cfg(8, 2, 128), 4)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_gguf_blocks_cut_by_input_blocks_of_32_match_the_dense_columns(kind: str) -> None:
    torch.manual_seed(0)
    rows, blocks_per_row = 6, 4
    width = {"q4_1": 20, "q8_0": 34}[kind]
    raw = torch.randint(0, 256, (rows, blocks_per_row * width), dtype=torch.uint8).numpy()
    if kind == "q4_1":  # finite half-float scales and mins
        raw.reshape(rows, blocks_per_row, width)[:, :, 0:4] = [0, 0x3C, 0, 0xBC]
    else:
        raw.reshape(rows, blocks_per_row, width)[:, :, 0:2] = [0, 0x3C]
    blocks = GGUFBlocks.from_raw(kind, raw)
    dense = blocks.dequantize()
    cut = _input_blocks(blocks, slice(32, 96))
    assert cut is not None and cut.shape == (rows, 64)
    assert torch.equal(cut.dequantize(), dense[:, 32:96])
    assert _input_blocks(blocks, slice(16, 48)) is None  # not on block edges: dense instead
    if blocks.pack_q8():  # int8-packed blocks (bf16 on VNNI) stay packed for their shard
        packed_cut = _input_blocks(blocks, slice(32, 96))
        assert packed_cut is not None and packed_cut.packed_q8 is not None


@pytest.mark.slow
def test_tp3_greedy_output_equals_tp1_on_the_default_model(smollm2_gguf: Path) -> None:
    """SmolLM2-135M (9 query heads, 3 KV heads: TP=3), float32, GGUF blocks for decodes."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far"]
    fields: dict[str, Any] = {
        "model": str(smollm2_gguf), "device": "cpu", "dtype": "float32",
        "num_gpu_blocks_override": 64, "max_num_seqs": 4,
    }  # fmt: skip
    single, _ = greedy_tokens(EngineConfig(**fields), prompts, 24)
    split, _ = greedy_tokens(EngineConfig(**fields, tensor_parallel_size=3), prompts, 24)
    assert split == single


def test_plan_sizes_one_rank(smollm2_gguf: Path) -> None:
    """`portico plan --tensor-parallel-size 3`: a third of the KV cache per token, the split
    projections divided by 3 and the replicated embedding whole."""
    from engine.memory_plan import plan

    fields: dict[str, Any] = {"model": str(smollm2_gguf), "device": "cpu", "dtype": "float32"}
    whole = plan(EngineConfig(**fields), memory_bytes=4 * 2**30)
    rank = plan(EngineConfig(**fields, tensor_parallel_size=3), memory_bytes=4 * 2**30)
    assert rank.kv_block_bytes * 3 == whole.kv_block_bytes
    cfg = whole.model_config
    embedding = cfg.vocab_size * cfg.hidden_size * 4
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * 4
    replicated = embedding + norms
    assert rank.weights.dense == replicated + (whole.weights.dense - replicated) // 3
    with pytest.raises(ValueError, match="must divide the model's attention heads \\(9\\)"):
        plan(EngineConfig(**fields, tensor_parallel_size=2), memory_bytes=4 * 2**30)
