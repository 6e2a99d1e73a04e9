"""The engine on a CUDA device (marker ``gpu``; ``make test-gpu``): skipped where torch sees
no CUDA device, which is every machine this suite has run on so far (issue 40: these tests
are written for the first GPU machine; the CPU tests drive the same code under
TRITON_INTERPRET in test_triton_engine.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine import kernels
from engine.memory_plan import cuda_memory
from engine.model_loader import load_model
from load import gpu_bench
from load.gpu_shapes import SHAPES, Shape
from portico.registry import resolve
from tests.engine.triton_engine_check import run_scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = Path(__file__).resolve().parents[2]
TINY = Shape("tiny", 64, 128, 2, 4, 2, 500, True, 1024)


def test_cuda_takes_the_triton_kernels() -> None:
    choice = kernels.choose("cuda")
    assert choice.paged_attention == choice.write_kv_cache == "triton"


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-8b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_triton_kernels_match_the_references_at_real_shapes(
    name: str, dtype: torch.dtype, kv: str
) -> None:
    case = gpu_bench.kernel_case(SHAPES[name], dtype, kv, seed=3)
    assert case["ok"], case


def test_engine_steps_on_cuda_give_the_cpu_paths_greedy_tokens(tiny_llama_dir: Path) -> None:
    """Prefill, decode, a cached prefix and a preemption on the device, float32."""
    on_cuda = run_scenario(tiny_llama_dir, "cuda")
    on_cpu = run_scenario(tiny_llama_dir, "cpu")
    assert on_cuda["num_preemptions"] > 0 and on_cuda["paged_attention"] == "triton"
    assert on_cuda["tokens"] == on_cpu["tokens"]


def test_greedy_tokens_equal_transformers_on_the_device(tmp_path: Path) -> None:
    result = gpu_bench.greedy_section(tmp_path, 16, "cuda", TINY, real_model=False)
    assert result["equal"] == result["prompts"] == 16, result["first_difference"]


def test_dummy_weights_are_made_on_the_device(tiny_llama_dir: Path) -> None:
    loaded = load_model(resolve(str(tiny_llama_dir)), torch.bfloat16, "cuda", load_format="dummy")
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    free, total, held = cuda_memory(loaded.device)
    assert 0 < free <= total and held >= torch.cuda.memory_allocated()


def _engine(model: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "portico.cli", "engine", "--model", str(model), "--device",
         "cuda", "--gpu-memory-utilization", "0.4", "--port", str(port)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_engines_at_0_4_share_the_card(tiny_llama_dir: Path) -> None:
    from load.gateway_stack import free_port

    ports = [free_port(), free_port()]
    procs = []
    try:
        for port in ports:  # one after the other: the second sizes beside the first
            procs.append(_engine(tiny_llama_dir, port))
            deadline = time.monotonic() + 300
            while procs[-1].poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).is_success:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            assert procs[-1].poll() is None, procs[-1].communicate()[1][-3000:]
        for port in ports:
            body = {"model": str(tiny_llama_dir), "prompt": [5, 6, 7], "max_tokens": 4}
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)


@pytest.mark.parametrize("folder", ["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir"])
def test_qwen_vision_models_on_cuda_give_the_cpu_paths_greedy_tokens(
    folder: str, request: pytest.FixtureRequest
) -> None:
    """Issue 46 on the device: two odd-sized images prefilled in chunks that cut through them,
    M-RoPE decode steps; float32, the same greedy tokens as on the CPU."""
    from tests.engine.qwen2_vl_triton_check import run_scenario as vision_scenario

    model_dir = Path(request.getfixturevalue(folder))
    on_cuda = vision_scenario(model_dir, "cuda")
    on_cpu = vision_scenario(model_dir, "cpu")
    assert on_cuda["attention"] == "triton" and on_cpu["attention"] == "cpu"
    assert on_cuda["tokens"] == on_cpu["tokens"] and len(on_cpu["tokens"]) == 12


def test_llava_on_cuda_gives_transformers_greedy_tokens(tiny_llava_dir: Path) -> None:
    """Issue 46 on the device: LLaVA (CLIP tower) with two images, float32, equals
    transformers' own generate on the CPU."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from portico.registry import ModelSource
    from tests.engine.test_llava import engine_inputs, hf_reference, picture, run

    loaded = load_model(ModelSource("tiny-llava", tiny_llava_dir, "hf"), torch.float32, "cuda")
    hf_model = LlavaForConditionalGeneration.from_pretrained(str(tiny_llava_dir)).eval()
    processor = AutoProcessor.from_pretrained(str(tiny_llava_dir))
    images = [picture(0), picture(1)]
    length, expected = hf_reference(hf_model, processor, "Compare the two pictures.", images)
    ids, mm = engine_inputs(loaded, "Compare the two pictures.", images)
    config = EngineConfig(model="tiny-llava", device="cuda", dtype="float32",
                          max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip
    [out] = run(LLMEngine(config, loaded), [(ids, mm, None)])
    assert len(ids) == length and out.outputs[0].token_ids == expected
