"""The whole engine through one kernel choice: one scenario, greedy tokens out.

Run as a script (``python triton_engine_check.py MODEL_DIR``) in a process whose environment
sets ``TRITON_INTERPRET=1`` and ``PORTICO_KERNEL_DEVICE=cuda`` before triton is imported: the
engine then takes the CUDA kernel choice (the Triton kernels) on CPU tensors, interpreted.
Prints one JSON line: the scenario's tokens and counters, and which kernels served them.
``test_triton_engine.py`` runs the same scenario in-process on the CPU path and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from engine import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource


def _tokens(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 4000 + 10 for i in range(n)]


def run_scenario(model_dir: Path, device: str = "cpu") -> dict[str, Any]:
    """A shared 32-token prefix (two full blocks), then four requests at once in a cache too
    small for them all (12 blocks of 16): prefill, decode, a prefix hit and a preemption."""
    imported_before = _triton_modules()
    loaded = load_model(ModelSource("tiny", model_dir, "hf"), torch.float32, device)
    config = EngineConfig(
        model="tiny", device=device, num_gpu_blocks_override=12, max_num_batched_tokens=96,
        preemption_mode="recompute",
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    prefix = _tokens(32, start=3)
    engine.add_request("first", prefix + _tokens(5, start=900), greedy)
    finals = _run_all(engine)
    for i in range(4):
        tail = _tokens(20 + 9 * i, start=1000 * (i + 1))
        engine.add_request(f"r{i}", prefix + tail, greedy)
    finals.update(_run_all(engine))
    stats = engine.stats()
    return {
        "tokens": {rid: list(out.outputs[0].token_ids) for rid, out in sorted(finals.items())},
        "cached": {rid: out.num_cached_tokens for rid, out in sorted(finals.items())},
        # the best two log-probabilities of every step: attention's numbers, not only argmaxes
        "logprobs": {
            rid: [[lp for _, lp in step.top_logprobs] for step in out.outputs[0].logprobs or []]
            for rid, out in sorted(finals.items())
        },
        "num_preemptions": stats.num_preemptions,
        "paged_attention": kernels.choose(device).paged_attention,
        "write_kv_cache": kernels.choose(device).write_kv_cache,
        # the Triton modules this scenario imported (another test may have imported some)
        "triton_modules": sorted(_triton_modules() - imported_before),
    }


def _triton_modules() -> set[str]:
    return {m for m in sys.modules if m.startswith("engine.kernels.triton")}


def _run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(run_scenario(Path(sys.argv[1]))), flush=True)
