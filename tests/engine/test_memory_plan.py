"""engine/memory_plan.py and ``portico plan``: the plan, made from the model's headers alone,
agrees with what a real engine started with the same flags allocates: the same number of KV
blocks, the KV bytes and the resident weight bytes within 5 %."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.config import EngineConfig, parse_memory
from engine.llm_engine import LLMEngine
from engine.memory_plan import (
    ACTIVATION_RESERVE_PER_TOKEN,
    gpu_share_flags,
    kv_cache_budget,
    plan,
)
from engine.models.block_linear import GGUFBlocks
from portico.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resident_weight_bytes(model: nn.Module) -> int:
    """Every tensor the loaded model holds: parameters, buffers, and the tensors its modules
    keep as plain attributes (RoPE tables, GGUF blocks, oneDNN-prepacked weights), each byte
    once: the union of their byte ranges (many views of one region, as the weight panels on
    huge pages are, count for what they cover; aliases of one tensor count once)."""
    opaque: set[int] = set()
    ranges: list[tuple[int, int]] = []
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if t.is_mkldnn:  # no address to compare: by identity
            if id(t) not in opaque:
                opaque.add(id(t))
                total += _tensor_bytes(t)
        elif _tensor_bytes(t):
            ranges.append((t.data_ptr(), t.data_ptr() + _tensor_bytes(t)))

    def tensors_of(value: object) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, GGUFBlocks):
            for f in dataclasses.fields(value):
                field = getattr(value, f.name)
                parts = field if isinstance(field, tuple) else (field,)  # the panels: a tuple
                yield from (t for t in parts if isinstance(t, torch.Tensor))

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            for t in tensors_of(value):
                add(t)
    end = 0
    for start, stop in sorted(ranges):
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def assert_close(planned: int, real: int) -> None:
    assert abs(planned - real) <= 0.05 * real, f"planned {planned}, allocated {real}"


def check_against_engine(config: EngineConfig) -> None:
    p = plan(config, memory_bytes=64 * 2**30)
    engine = LLMEngine.from_config(config)
    runner = engine.runner
    assert p.num_blocks == runner.num_gpu_blocks
    assert_close(p.num_blocks * p.kv_block_bytes, sum(_tensor_bytes(t) for t in runner.kv_caches))
    assert p.max_model_len == engine.max_model_len
    assert_close(p.weights.total, resident_weight_bytes(runner.model))


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8"), ("float32", "fp8_e4m3")],
)
def test_plan_matches_the_engine_on_the_tiny_model(
    tiny_llama_dir: Path, one_torch_thread: None, dtype: str, kv_cache_dtype: str
) -> None:
    config = EngineConfig(
        model=str(tiny_llama_dir),
        device="cpu",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=4,
        max_model_len=512,
        kv_cache_memory="3MiB",
    )
    check_against_engine(config)


@pytest.mark.slow
# auto: a float16 cache; bfloat16: int8-packed blocks too
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_plan_matches_the_engine_on_the_default_gguf(
    smollm2_gguf: Path, one_torch_thread: None, dtype: str
) -> None:
    config = EngineConfig(
        model="smollm2-135m", device="cpu", dtype=dtype, max_num_seqs=8, kv_cache_memory="64MiB"
    )
    p = plan(config, memory_bytes=64 * 2**30)
    assert p.quantization == "gguf" or p.weights.gguf_blocks == 0
    # the default path's auto cache is float16 (engine.numerics); a named dtype keeps its own
    assert p.kv_cache_dtype == ("float16" if dtype == "auto" else p.dtype)
    check_against_engine(config)


GIB = 2**30


def test_cuda_budget_is_the_share_of_the_total_less_what_the_engine_holds() -> None:
    """vLLM's --gpu-memory-utilization: a fraction of the card's total, weights included."""
    config = EngineConfig(gpu_memory_utilization=0.9, max_num_batched_tokens=1024)
    reserve = 1024 * ACTIVATION_RESERVE_PER_TOKEN
    held, total = 3 * GIB, 80 * GIB  # context + weights of this engine
    expected = int(total * 0.9) - held - reserve
    assert kv_cache_budget(config, "cuda", total - held, total, held) == expected
    # what others hold does not shrink the share while it leaves the share free
    assert kv_cache_budget(config, "cuda", total - held - 4 * GIB, total, held) == expected
    assert kv_cache_budget(EngineConfig(kv_cache_memory="1GiB"), "cpu") == GIB


def test_two_engines_at_0_4_share_a_card_and_a_third_is_refused() -> None:
    config = EngineConfig(gpu_memory_utilization=0.4, max_num_batched_tokens=2048)
    total, held = 141 * GIB, 2 * GIB
    reserve = 2048 * ACTIVATION_RESERVE_PER_TOKEN
    first = kv_cache_budget(config, "cuda", total - held, total, held)
    first_uses = held + first + reserve
    assert first_uses == int(total * 0.4)
    second = kv_cache_budget(config, "cuda", total - first_uses - held, total, held)
    assert second == first  # the second engine's cache is as large as the first's
    free = total - 2 * first_uses - held
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.4 gives this engine"):
        kv_cache_budget(config, "cuda", free, total, held)  # a third: 0.2 of the card is free
    # 0.9 beside an engine at 0.4 (the old default, issue 40) is refused, naming the flag
    greedy = EngineConfig(gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="other processes hold"):
        kv_cache_budget(greedy, "cuda", total - first_uses - held, total, held)


def test_engines_sharing_a_card_split_the_utilization_and_fit_together() -> None:
    """The fairness and fleet benches' flags: N engines on one CUDA card, 0.9 split evenly."""
    assert gpu_share_flags(["--device", "cuda"], 2, False) == [
        "--device", "cuda", "--gpu-memory-utilization", "0.45",
    ]  # fmt: skip
    assert gpu_share_flags([], 3, True)[-1] == "0.3"
    assert gpu_share_flags(["--max-num-seqs", "8"], 2, False) == ["--max-num-seqs", "8"]  # CPU
    assert gpu_share_flags(["--device=cpu"], 2, True) == ["--device=cpu"]
    mine = ["--device", "cuda", "--gpu-memory-utilization=0.3"]
    assert gpu_share_flags(mine, 2, True) == mine  # the user's own split is kept
    share = float(gpu_share_flags([], 2, True)[-1])
    config = EngineConfig(gpu_memory_utilization=share, max_num_batched_tokens=2048)
    total, held = 141 * GIB, 2 * GIB
    first = kv_cache_budget(config, "cuda", total - held, total, held)
    first_uses = held + first + 2048 * ACTIVATION_RESERVE_PER_TOKEN
    assert kv_cache_budget(config, "cuda", total - first_uses - held, total, held) == first


def test_cuda_plan_for_a_device_this_machine_lacks(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cuda", max_model_len=256)
    p = plan(config, memory_bytes=4 * GIB)
    assert p.dtype == "bfloat16" and p.quantization == "none" and p.used_bytes == 0
    used = p.cuda_context_bytes + p.weights.total + p.activation_reserve_bytes
    budget = 4 * GIB - used - p.outside_share_bytes
    assert p.num_blocks == budget // p.kv_block_bytes
    assert p.fits and p.total_bytes <= 4 * GIB * 0.9


def test_cuda_plan_beside_another_engine_matches_the_engines_rule(tiny_llama_dir: Path) -> None:
    """``portico plan --device cuda`` and the engine size with one function: given the card's
    total and what others hold, the same blocks; the plan's total is the engine's share."""
    config = EngineConfig(model=str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.4)
    total, other = 8 * GIB, int(8 * GIB * 0.4)
    p = plan(config, memory_bytes=total, used_bytes=other)
    engine_holds = p.cuda_context_bytes + p.weights.total
    budget = kv_cache_budget(config, "cuda", total - other - engine_holds, total, engine_holds)
    assert p.num_blocks == budget // p.kv_block_bytes and p.used_bytes == other
    assert p.fits and p.total_bytes <= int(total * 0.4)
    result = portico(
        "plan", "--model", str(tiny_llama_dir), "--device", "cuda", "--memory", "8GiB",
        "--memory-used", "6GiB", "--gpu-memory-utilization", "0.4",
    )  # fmt: skip
    assert result.returncode == 2 and "other processes hold" in result.stderr
    shown = portico(
        "plan", "--model", str(tiny_llama_dir), "--device", "cuda", "--memory", "8GiB",
        "--memory-used", f"{other}", "--gpu-memory-utilization", "0.4",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert f"({p.num_blocks} blocks" in shown.stdout and "engine's share" in shown.stdout
    assert "--gpu-memory-utilization 0.4" in shown.stdout.splitlines()[-1]


def test_plan_of_dummy_weights_needs_no_safetensors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """--load-format dummy plans a folder holding only config.json and a tokenizer."""
    import shutil

    folder = tmp_path / "shape-only"
    shutil.copytree(tiny_llama_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", load_format="dummy")
    dummy = plan(config, memory_bytes=GIB)
    real = plan(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32"), GIB)
    assert dummy.weights == real.weights and dummy.num_blocks == real.num_blocks
    result = portico("plan", "--model", str(folder), "--device", "cpu", "--memory", "1GiB")
    assert result.returncode == 2 and "no .safetensors" in result.stderr


# --------------------------------------------------------------------------- the command


def portico_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m portico.cli ARGS`` as a user runs it, in a clean environment."""
    return subprocess.run(
        [sys.executable, "-m", "portico.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )


def portico(*args: str) -> subprocess.CompletedProcess[str]:
    """The same command through ``portico.cli.main`` in this process: the exit code (argparse's
    SystemExit included), stdout and stderr, without a new interpreter importing torch and
    transformers (~3.5 s of CPU a run). The entry point itself is run by the first test."""
    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("OMP_WAIT_POLICY")  # main() sets it when unset
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = saved
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def test_plan_command_prints_the_flags_that_fit(tiny_llama_dir: Path) -> None:
    result = portico_process(
        "plan", "--model", str(tiny_llama_dir), "--device", "cpu", "--max-model-len", "512",
        "--max-num-seqs", "8", "--memory", "1GiB", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["fits"] is False  # as given: the default 2 GiB cache exceeds the 1 GiB
    flags = data["flags"]
    kv = flags[flags.index("--kv-cache-memory") + 1]
    # the recommended cache holds every sequence at full length
    assert int(kv.removesuffix("MiB")) * 2**20 >= 8 * data["kv_bytes_per_seq"]
    again = plan(
        EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            max_model_len=512,
            max_num_seqs=8,
            kv_cache_memory=kv,
        ),  # fmt: skip
        memory_bytes=2**30,
    )
    assert again.full_length_seqs >= 8 and again.fits


def test_an_int8_kv_cache_plans_about_twice_the_blocks_and_keeps_its_flag(
    tiny_llama_dir: Path,
) -> None:
    base = EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="bfloat16",
                        kv_cache_memory="8MiB")  # fmt: skip
    bf16 = plan(base, memory_bytes=2**30)
    int8 = plan(dataclasses.replace(base, kv_cache_dtype="int8"), memory_bytes=2**30)
    head_dim = bf16.model_config.head_dim
    # half of bf16's bytes per value, plus a 4-byte scale per row of head_dim values
    assert int8.kv_block_bytes * 2 * head_dim == bf16.kv_block_bytes * (head_dim + 4)
    assert int8.num_blocks >= 1.5 * bf16.num_blocks
    result = portico_process(
        "plan", "--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "bfloat16",
        "--kv-cache-dtype", "int8", "--memory", "1GiB", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    flags = json.loads(result.stdout)["flags"]
    assert flags[flags.index("--kv-cache-dtype") + 1] == "int8"


@pytest.mark.parametrize(
    ("memory", "advice"),
    [
        # ~12.3 MiB of tiny float32 weights and ~17.5 MiB of activations (logits of 64 rows,
        # a 2048-token step) leave ~10 MiB (20 sequences of 1024 tokens) in 40 MiB, and
        # ~150 KiB (304 tokens) in 30 MiB (float32 given: --dtype auto is bf16 on CPUs with
        # native bf16)
        ("40MiB", "--max-num-seqs 20 "),
        ("30MiB", "--max-model-len 304 --max-num-seqs 1 "),
    ],
)
def test_plan_command_shrinks_what_does_not_fit(
    tiny_llama_dir: Path, memory: str, advice: str
) -> None:
    result = portico(
        "plan", "--model", str(tiny_llama_dir), "--device", "cpu", "--max-model-len", "1024",
        "--max-num-seqs", "64", "--memory", memory, "--dtype", "float32",
        "--max-num-batched-tokens", "2048",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "does NOT fit" in result.stdout  # the default 2 GiB cache, as given
    command = result.stdout.splitlines()[-1]
    assert command.startswith("portico engine --model") and advice in command
    kv = command.split("--kv-cache-memory ")[1]
    flags = command.split()
    given = EngineConfig(
        model=str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        max_model_len=int(flags[flags.index("--max-model-len") + 1]),
        max_num_seqs=int(flags[flags.index("--max-num-seqs") + 1]),
        kv_cache_memory=kv,
    )
    replanned = plan(given, memory_bytes=parse_memory(memory))
    assert replanned.fits and replanned.full_length_seqs >= given.max_num_seqs


def test_plan_command_fails_when_the_weights_alone_do_not_fit(tiny_llama_dir: Path) -> None:
    result = portico("plan", "--model", str(tiny_llama_dir), "--device", "cpu", "--memory", "8MiB")
    assert result.returncode == 1
    assert "do not leave room for one KV block" in result.stdout
    assert "portico engine" not in result.stdout


def test_plan_command_rejects_bad_input(tiny_llama_dir: Path) -> None:
    bad_memory = portico("plan", "--model", str(tiny_llama_dir), "--memory", "lots")
    assert bad_memory.returncode == 2 and "--memory" in bad_memory.stderr
    too_long = portico("plan", "--model", str(tiny_llama_dir), "--max-model-len", "999999")
    assert too_long.returncode == 2 and "--max-model-len" in too_long.stderr
    missing = portico("plan", "--model", "/nonexistent/model")
    assert missing.returncode == 2 and "/nonexistent/model" in missing.stderr
