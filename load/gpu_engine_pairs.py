"""Sections of ``portico bench gpu`` that run one workload on two engine configurations, one
after the other on the same card: (f) bf16 against ``--quantization fp8``, (g) synchronous
steps against ``--async-scheduling``, (h) the default against ``--batch-invariant``. Each
engine is warmed up first; dummy weights."""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

from load.gpu_shapes import SHAPES, Shape, write_shape_folder

FP8_REQUESTS, FP8_OUTPUT = 64, 128  # (f): the 1B-class shape at c=64, bf16 vs fp8
ASYNC_REQUESTS, ASYNC_OUTPUT = 64, 128  # (g): the default model's shape at c=64
INVARIANT_REQUESTS, INVARIANT_OUTPUT = 64, 64  # (h): the default model's shape at c=64


def free_cuda() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare_engines(
    workdir: Path,
    shape: Shape,
    variants: dict[str, dict[str, Any]],
    requests: int,
    output: int,
    device: str,
) -> dict[str, Any]:
    """Per variant (EngineConfig fields over a bf16 dummy-weight engine of ``shape``): one
    stream's decode rate and ``requests`` requests of ``output`` tokens at once."""
    from engine.llm_engine import LLMEngine
    from load.engine_bench import Workload, run_portico, single_stream

    folder = write_shape_folder(workdir / f"{shape.name}-shape", shape)
    rng = random.Random(1)
    prompts = [[rng.randrange(10, shape.vocab_size) for _ in range(rng.randint(64, 256))]
               for _ in range(requests)]  # fmt: skip
    work = Workload(prompts, [output] * requests)
    runs: dict[str, Any] = {}
    for name, overrides in variants.items():
        engine = LLMEngine.from_config(_config(folder, device, requests, overrides))
        try:
            run_portico(engine, Workload([[7 + i] * 32 for i in range(4)], [4] * 4))  # warm-up
            runs[name] = {
                "single_stream": single_stream(engine, prompts[0], output),
                f"c{requests}": run_portico(engine, work),
            }
        finally:
            engine.close()
            del engine
            free_cuda()
    return runs


def _config(folder: Path, device: str, requests: int, overrides: dict[str, Any]) -> Any:
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(folder), device=device, load_format="dummy", dtype="bfloat16",
        max_num_seqs=max(requests, 1), gpu_memory_utilization=0.4,
        num_gpu_blocks_override=None if device == "cuda" else 256, **overrides,
    )  # fmt: skip


def same_tokens_alone_and_batched(
    folder: Path, device: str, overrides: dict[str, Any], vocab_size: int, output: int
) -> bool:
    """Whether one prompt's greedy tokens are the same alone and then again beside 15 other
    prompts (its prefix cached by then), on one engine with ``overrides``."""
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    rng = random.Random(2)
    prompt = [rng.randrange(10, vocab_size) for _ in range(200)]
    others = [[rng.randrange(10, vocab_size) for _ in range(rng.randint(16, 300))]
              for _ in range(15)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    engine = LLMEngine.from_config(_config(folder, device, 16, overrides))
    try:
        llm = LLM.from_engine(engine)
        alone = llm.generate([prompt], params)[0].outputs[0].token_ids
        batched = llm.generate([*others[:7], prompt, *others[7:]], params)[7].outputs[0].token_ids
    finally:
        engine.close()
        del engine
        free_cuda()
    return list(alone) == list(batched)


def _ratio(runs: dict[str, Any], new: str, old: str, key: str, field: str) -> float:
    return round(runs[new][key][field] / max(runs[old][key][field], 1e-9), 3)


def fp8_section(
    workdir: Path,
    device: str = "cuda",
    shape: Shape = SHAPES["llama-1b"],
    requests: int = FP8_REQUESTS,
    output: int = FP8_OUTPUT,
) -> dict[str, Any]:
    """``--quantization fp8`` against bf16 on ``shape`` (the 1B-class shape by default): one
    stream's decode tok/s and ``requests`` at once (64: issue 41's c=64 row)."""
    variants = {"bf16": {"quantization": "none"}, "fp8": {"quantization": "fp8"}}
    runs = compare_engines(workdir, shape, variants, requests, output, device)
    speedup = _ratio(runs, "fp8", "bf16", f"c{requests}", "output_tokens_per_s")
    return {"shape": shape.name, "requests": requests, "output_tokens": output, "runs": runs,
            f"fp8_speedup_c{requests}": speedup}  # fmt: skip


def async_section(
    workdir: Path,
    device: str = "cuda",
    shape: Shape = SHAPES["smollm2-135m"],
    requests: int = ASYNC_REQUESTS,
    output: int = ASYNC_OUTPUT,
) -> dict[str, Any]:
    """``--async-scheduling`` against synchronous steps on ``shape`` (the default model's by
    default, where a step is launch-bound): one stream and ``requests`` at once."""
    variants = {"sync": {"async_scheduling": False}, "async": {"async_scheduling": True}}
    runs = compare_engines(workdir, shape, variants, requests, output, device)
    return {
        "shape": shape.name, "requests": requests, "output_tokens": output, "runs": runs,
        "async_speedup_single_stream": _ratio(
            runs, "async", "sync", "single_stream", "decode_tokens_per_s"),
        f"async_speedup_c{requests}": _ratio(
            runs, "async", "sync", f"c{requests}", "output_tokens_per_s"),
    }  # fmt: skip


def invariant_section(
    workdir: Path,
    device: str = "cuda",
    shape: Shape = SHAPES["smollm2-135m"],
    requests: int = INVARIANT_REQUESTS,
    output: int = INVARIANT_OUTPUT,
) -> dict[str, Any]:
    """``--batch-invariant`` against the default on ``shape``: one stream and ``requests`` at
    once (what the mode costs), and under each whether a prompt's greedy tokens are the same
    alone and inside a batch (issue 42's item 4 on a card)."""
    variants = {"default": {}, "invariant": {"batch_invariant": True}}
    runs = compare_engines(workdir, shape, variants, requests, output, device)
    folder = workdir / f"{shape.name}-shape"
    same = {name: same_tokens_alone_and_batched(folder, device, overrides, shape.vocab_size, output)
            for name, overrides in variants.items()}  # fmt: skip
    return {
        "shape": shape.name, "requests": requests, "output_tokens": output, "runs": runs,
        "same_tokens_alone_and_batched": same,
        "invariant_cost_single_stream": _ratio(
            runs, "invariant", "default", "single_stream", "decode_tokens_per_s"),
        f"invariant_cost_c{requests}": _ratio(
            runs, "invariant", "default", f"c{requests}", "output_tokens_per_s"),
    }  # fmt: skip
