"""EngineConfig: vLLM flag names on the command line, defaults, and errors naming the flag."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    return EngineConfig.from_cli_args(parser.parse_args(list(argv)))


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert parse() == EngineConfig()
    config = EngineConfig()
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (16, 64, 512)
    assert config.enable_prefix_caching and config.enable_chunked_prefill
    assert config.preemption_mode == "recompute" and config.kv_cache_memory_bytes == 2 * 2**30
    assert config.swap_space_bytes == 2**30 and config.model_name == "smollm2-135m"


def test_every_flag_reaches_its_field() -> None:
    config = parse(
        "--model", "/models/tiny", "--served-model-name", "tiny", "--dtype", "float16",
        "--device", "cpu", "--block-size", "32", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--max-model-len", "1024",
        "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--preemption-mode", "swap",
        "--swap-space", "0.5", "--kv-cache-memory", "256MiB", "--gpu-memory-utilization", "0.5",
        "--seed", "7", "--num-gpu-blocks-override", "100",
    )  # fmt: skip
    assert config == EngineConfig(
        model="/models/tiny",
        served_model_name="tiny",
        dtype="float16",
        device="cpu",
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        preemption_mode="swap",
        swap_space=0.5,
        kv_cache_memory="256MiB",
        gpu_memory_utilization=0.5,
        seed=7,
        num_gpu_blocks_override=100,
    )
    assert config.model_name == "tiny" and config.kv_cache_memory_bytes == 256 * 2**20
    assert parse("--enable-prefix-caching").enable_prefix_caching


def test_from_cli_args_ignores_foreign_flags_and_keeps_defaults_for_missing_ones() -> None:
    args = argparse.Namespace(port=8000, api_key="x", max_num_seqs=3)
    config = EngineConfig.from_cli_args(args)
    assert config.max_num_seqs == 3 and config.block_size == 16


@pytest.mark.parametrize(
    ("flag", "kwargs"),
    [
        ("--dtype", {"dtype": "int8"}),
        ("--device", {"device": "tpu"}),
        ("--preemption-mode", {"preemption_mode": "drop"}),
        ("--block-size", {"block_size": 0}),
        ("--block-size", {"block_size": 24}),
        ("--max-num-seqs", {"max_num_seqs": 0}),
        ("--max-num-batched-tokens", {"max_num_batched_tokens": -5}),
        ("--max-model-len", {"max_model_len": 0}),
        ("--num-gpu-blocks-override", {"num_gpu_blocks_override": 0}),
        ("--seed", {"seed": -1}),
        ("--swap-space", {"swap_space": -1.0}),
        ("--swap-space", {"swap_space": float("nan")}),
        ("--gpu-memory-utilization", {"gpu_memory_utilization": 0}),
        ("--gpu-memory-utilization", {"gpu_memory_utilization": 1.5}),
        ("--kv-cache-memory", {"kv_cache_memory": "lots"}),
        ("--kv-cache-memory", {"kv_cache_memory": 0}),
        ("--model", {"model": ""}),
    ],
)
def test_bad_values_raise_naming_the_flag(flag: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=f"^{flag} "):
        EngineConfig(**kwargs)


def test_a_bad_flag_value_on_the_command_line_is_refused() -> None:
    with pytest.raises(ValueError, match="--block-size"):
        parse("--block-size", "12")


def test_the_step_budget_defaults_by_device_and_an_explicit_one_wins() -> None:
    assert EngineConfig(device="cpu").max_num_batched_tokens == 512
    assert EngineConfig(device="cuda").max_num_batched_tokens == 2048
    assert parse("--device", "cuda").max_num_batched_tokens == 2048
    assert parse("--device", "cuda", "--max-num-batched-tokens", "96").max_num_batched_tokens == 96
    assert EngineConfig(device="cpu", max_num_batched_tokens=4096).max_num_batched_tokens == 4096
