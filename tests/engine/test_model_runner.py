"""The model runner: scheduler output -> flat batch -> logits of the rows to sample.

Driven by hand-written scheduler outputs (real ``Request`` and ``SchedulerOutput`` objects) so
each case is exact: chunked prefill, decodes and prefills in one step, shuffled block tables.
Greedy decoding through the runner must reproduce transformers' greedy generation.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner, kv_cache_bytes_per_block, num_kv_blocks
from engine.models.llama import LlamaForCausalLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from portico.registry import resolve

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(resolve(str(tiny_llama_dir)), torch.float32, "cpu")


def _requests(vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(11)
    return [
        Request(name, torch.randint(0, vocab, (n,), generator=gen).tolist(), SamplingParams())
        for name, n in (("a", 11), ("b", 19), ("c", 6))
    ]


def _tables(requests: list[Request], max_new: int) -> dict[str, list[int]]:
    rng = random.Random(3)
    pool = list(range(1, 40))
    rng.shuffle(pool)  # not contiguous
    tables = {}
    for req in requests:
        need = -(-(req.num_tokens + max_new) // BLOCK_SIZE)
        tables[req.request_id], pool = pool[:need], pool[need:]
    return tables


def _step(runner: ModelRunner, out: SchedulerOutput) -> list[Request]:
    """Execute, then do what the scheduler would: advance and append the greedy token."""
    sampled, logits = runner.execute(out)
    assert logits.shape == (len(sampled), runner.config.vocab_size)
    assert logits.dtype == torch.float32
    for req, n in out.scheduled:
        req.num_computed_tokens += n
    for req, row in zip(sampled, logits, strict=True):
        req.append_output_token(int(row.argmax()))
    return sampled


def test_greedy_decoding_through_runner_matches_transformers(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE)
    runner = ModelRunner(tiny, config, num_gpu_blocks=40)
    assert len(runner.kv_caches) == tiny.config.num_hidden_layers
    assert runner.kv_caches[0].shape == (2, 40, BLOCK_SIZE, 2, 16)
    a, b, c = reqs = _requests(tiny.config.vocab_size)
    tables = _tables(reqs, max_new=6)

    def out(*scheduled: tuple[Request, int]) -> SchedulerOutput:
        return SchedulerOutput(scheduled=list(scheduled), block_tables=tables)

    # A full prefill and a partial one: only A needs a token.
    assert _step(runner, out((a, 11), (b, 8))) == [a]
    # A decode, B's last chunk, C's whole prompt.
    assert _step(runner, out((a, 1), (b, 11), (c, 6))) == [a, b, c]
    for _ in range(3):  # decodes only
        assert _step(runner, out((a, 1), (b, 1), (c, 1))) == [a, b, c]
    assert _step(runner, out((b, 1))) == [b]

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    for req in reqs:
        prompt = torch.tensor([req.prompt_token_ids])
        with torch.inference_mode():
            expected = reference.generate(
                prompt, max_new_tokens=req.num_output_tokens, do_sample=False,
                attention_mask=torch.ones_like(prompt), pad_token_id=0,
            )[0].tolist()  # fmt: skip
        assert req.all_token_ids == expected, req.request_id


def test_partial_prefill_returns_no_rows(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    runner = ModelRunner(tiny, EngineConfig(model=str(tiny_llama_dir), block_size=4), 20)
    req = _requests(tiny.config.vocab_size)[1]
    sampled, logits = runner.execute(
        SchedulerOutput(scheduled=[(req, 5)], block_tables={"b": [3, 1, 7, 2, 9, 4, 5]})
    )
    assert sampled == [] and logits.shape == (0, tiny.config.vocab_size)
    # The five tokens' keys landed in the first two blocks of the table, nowhere else.
    written = runner.kv_caches[0][0].flatten(1).abs().sum(dim=1) > 0  # per block, K half
    assert written.nonzero().flatten().tolist() == [1, 3]


def test_swap_round_trip_restores_blocks(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE)
    runner = ModelRunner(tiny, config, num_gpu_blocks=12, num_cpu_blocks=4)
    for cache in runner.kv_caches:
        cache.normal_()
    before = [cache.clone() for cache in runner.kv_caches]
    runner.swap([(5, 0), (7, 3)], [])
    for cache in runner.kv_caches:
        cache[:, [5, 7]] = 0
    runner.swap([], [(0, 9), (3, 2)])
    for old, new in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(new[:, 9], old[:, 5]) and torch.equal(new[:, 2], old[:, 7])
        assert torch.equal(new[:, 0], old[:, 0])  # untouched blocks stay


def test_swap_without_swap_space_is_an_error(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    runner = ModelRunner(tiny, EngineConfig(model=str(tiny_llama_dir)), num_gpu_blocks=4)
    assert runner.num_cpu_blocks == 0  # recompute mode: no CPU pool
    with pytest.raises(RuntimeError, match="no CPU swap space"):
        runner.swap([(1, 0)], [])


def test_swap_mode_sizes_the_cpu_pool_from_swap_space(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir), block_size=16, preemption_mode="swap", swap_space=0.001
    )
    runner = ModelRunner(tiny, config, num_gpu_blocks=4)
    per_block = kv_cache_bytes_per_block(tiny.config, 16, torch.float32)
    assert runner.num_cpu_blocks == int(0.001 * 2**30) // per_block


def test_kv_cache_sizing(tiny: LoadedModel, tiny_llama_dir: Path) -> None:
    # 2 (K and V) x 2 layers x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    assert kv_cache_bytes_per_block(tiny.config, 16, torch.float32) == 2 * 2 * 16 * 2 * 16 * 4
    assert kv_cache_bytes_per_block(tiny.config, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 16 * 2
    model = str(tiny_llama_dir)
    assert num_kv_blocks(tiny, EngineConfig(model=model, kv_cache_memory="1MiB")) == 2**20 // 8192
    assert num_kv_blocks(tiny, EngineConfig(model=model, num_gpu_blocks_override=7)) == 7
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(tiny, EngineConfig(model=model, kv_cache_memory=100))


def test_sequence_past_the_model_context_is_rejected(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    runner = ModelRunner(tiny, EngineConfig(model=str(tiny_llama_dir), block_size=256), 6)
    req = Request("long", [1] * 1025, SamplingParams())  # the tiny model knows 1024 positions
    out = SchedulerOutput(scheduled=[(req, 1025)], block_tables={"long": [1, 2, 3, 4, 5]})
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        runner.execute(out)


def test_pool_sizing() -> None:
    """SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, float32 (meta weights: no memory)."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=576, intermediate_size=64,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    per_block = kv_cache_bytes_per_block(cfg, 16, torch.float32)
    assert per_block == 30 * 3 * 64 * 2 * 16 * 4
    with torch.device("meta"):
        loaded = LoadedModel(LlamaForCausalLM(cfg), cfg, tokenizer=None)  # type: ignore[arg-type]
    config = EngineConfig(model="smollm2-135m", kv_cache_memory=2 * 2**30)
    assert num_kv_blocks(loaded, config) == 2 * 2**30 // per_block
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(loaded, EngineConfig(model="smollm2-135m", kv_cache_memory=per_block - 1))
