"""``portico bench gpu``'s parts that a CPU can run: the shapes against the engine's own
parameter count, the byte accounting by hand, the dummy-weights folder served by a real
engine, a kernel case under TRITON_INTERPRET, the greedy comparison against transformers at a
tiny shape, the report and its plot, and the refusal without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.memory_plan import config_tensors
from engine.sampling_params import SamplingParams
from load import gpu_bench
from load.gpu_shapes import (
    SHAPES,
    Shape,
    bandwidth_row,
    build_report,
    decode_attention_bytes,
    decode_step_bytes,
    ideal_ms,
    summary_lines,
    write_shape_folder,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = Shape("tiny", 64, 128, 2, 4, 2, 500, True, 1024)


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_parameter_counts_are_the_engines(name: str, tmp_path: Path) -> None:
    shape = SHAPES[name]
    (tmp_path / "config.json").write_text(json.dumps(shape.hf_config()))
    cfg, tensors = config_tensors(tmp_path)
    assert sum(t.numel for t in tensors) == shape.num_params
    assert (cfg.head_dim, cfg.num_key_value_heads) == (shape.head_dim, shape.num_key_value_heads)
    if name == "llama-1b":  # the brief's 1B-class shape
        assert (shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads) == (
            2048, 16, 32)  # fmt: skip
        assert 1.2e9 < shape.num_params < 1.3e9


def test_decode_bytes_by_hand() -> None:
    s = SHAPES["smollm2-135m"]  # 3 KV heads of 64
    per_layer = decode_attention_bytes(s, 64, 1024, 2)
    assert per_layer == 64 * 1024 * (2 * 3 * 64 * 2) + 2 * 64 * 9 * 64 * 2
    step = decode_step_bytes(s, 64, 1024, 2, 2)
    assert step["weights"] == s.num_params * 2  # tied: the head is the embedding, read once
    assert step["attention"] == 30 * per_layer
    assert step["kv_write"] == 30 * 64 * 2 * 3 * 64 * 2
    assert step["total"] == step["weights"] + step["attention"] + step["kv_write"]
    big = SHAPES["llama-8b"]  # untied: the embedding only gathers rows
    weights = decode_step_bytes(big, 1, 1, 2, 2)["weights"]
    assert weights == (big.num_params - big.vocab_size * big.hidden_size) * 2
    assert ideal_ms(4.8e9, 4800.0) == pytest.approx(1.0)
    row = bandwidth_row(s, 64, 1024, per_layer / 2.4e12, 4000.0, step_tpot_ms=10.0)
    assert row["attention_gbs"] == 2400.0 and row["attention_share_of_copy"] == 0.6
    assert row["step_floor_ms"] == round(ideal_ms(step["total"], 4000.0), 3)
    assert row["tpot_over_floor"] == round(10.0 / row["step_floor_ms"], 2)


def test_a_shape_folder_is_served_with_dummy_weights_and_every_token_decodes(
    tmp_path: Path,
) -> None:
    folder = write_shape_folder(tmp_path / "tiny", TINY)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32",
                          load_format="dummy", num_gpu_blocks_override=32)  # fmt: skip
    engine = LLMEngine.from_config(config)
    out = LLM.from_engine(engine).generate(
        [[7, 8, 9], [400, 401]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    for o in out:
        ids = o.outputs[0].token_ids
        assert o.outputs[0].text.split() == [f"t{i}" for i in ids]
    assert engine.tokenizer.decode([499]) == "t499"


def test_a_kernel_case_under_the_interpreter_builds_a_passing_report(tmp_path: Path) -> None:
    script = (
        "import json, torch\n"
        "from load.gpu_bench import attention_seconds, kernel_case\n"
        "from load.gpu_shapes import Shape\n"
        "shape = Shape('tiny', 64, 128, 2, 4, 2, 500, True)\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for kv in ('auto', 'int8'):\n"
        "        print(json.dumps(kernel_case(shape, dtype, kv, 0, 'cpu', "
        "[(1, 40), (9, 9), (3, 20)])))\n"
        "print(attention_seconds(shape, 2, 40, 'cpu'))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *lines, seconds = proc.stdout.splitlines()
    assert float(seconds) > 0  # section (e)'s kernel timing runs the Triton decode
    cases = [json.loads(line) for line in lines]
    assert len(cases) == 4 and all(c["ok"] and c["cache_equal"] for c in cases), cases
    sections = {"kernels": {"cases": cases}, "greedy": {"prompts": 16, "equal": 16,
                                                        "model": "tiny"}}  # fmt: skip
    report = build_report({"name": "a CPU"}, sections, 1.0, "portico bench gpu")
    assert report["verdicts"] == {"kernels_match": True, "greedy_equal": True}
    assert report["sections"]["served"] == {"skipped": "not run"}
    lines = summary_lines(report)
    assert "(a) kernels vs references: 4/4 cases match" in lines
    assert any("(served) not run" in line for line in lines)
    failed = build_report({}, {"kernels": {"cases": [*cases, {**cases[0], "ok": False}]}}, 1, "")
    assert failed["verdicts"] == {"kernels_match": False, "greedy_equal": False}
    assert gpu_bench.plot(report, tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.slow  # ~20 s: two engines and transformers, 16 prompts each
def test_greedy_comparison_with_transformers_at_a_tiny_shape(tmp_path: Path) -> None:
    """Section (b) on the CPU: random weights saved once, loaded by both sides."""
    torch.set_num_threads(1)
    result = gpu_bench.greedy_section(tmp_path, 12, "cpu", TINY, real_model=False)
    assert result["model"] == "tiny shape, random weights" and result["prompts"] == 16
    assert result["prefix_cached_tokens"] >= 7 * 48  # the shared prefix, after its first run
    assert result["equal"] == result["equal_prefix_caching_off"] == 16, result["first_difference"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "bench", "gpu", "--out", str(tmp_path / "r.json")],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_fp8_section_runs_both_engines_at_a_tiny_shape(tmp_path: Path) -> None:
    """Section (f) on the CPU (torch's fp8 kernel there): bf16 and fp8 engines on dummy
    weights, one stream and a batch; the report's summary names both."""
    torch.set_num_threads(1)
    result = gpu_bench.fp8_section(tmp_path, "cpu", TINY, requests=3, output=4)
    assert set(result["runs"]) == {"bf16", "fp8"} and result["shape"] == "tiny"
    for run in result["runs"].values():
        assert run["single_stream"]["output_tokens"] == 4
        assert run["c3"]["output_tokens_per_s"] > 0
    assert result["fp8_speedup_c3"] > 0
    report = build_report({"name": "a CPU"}, {"fp8": result}, 1.0, "portico bench gpu")
    lines = summary_lines(report)
    assert sum(line.startswith("(f) tiny ") for line in lines) == 2
    assert any("(greedy) not run" in line for line in lines)


def test_the_async_section_runs_both_engines_at_a_tiny_shape(tmp_path: Path) -> None:
    """Section (g) on the CPU: synchronous and --async-scheduling engines on dummy weights,
    one stream and a batch (each produces every token, or run_portico raises); the report's
    summary names both. Timings on a CPU say nothing of a GPU's overlap."""
    torch.set_num_threads(1)
    result = gpu_bench.async_section(tmp_path, "cpu", TINY, requests=3, output=4)
    assert set(result["runs"]) == {"sync", "async"} and result["shape"] == "tiny"
    for run in result["runs"].values():
        assert run["single_stream"]["output_tokens"] == 4
        assert run["c3"]["output_tokens_per_s"] > 0
    assert result["async_speedup_c3"] > 0 and result["async_speedup_single_stream"] > 0
    report = build_report({"name": "a CPU"}, {"async": result}, 1.0, "portico bench gpu")
    lines = summary_lines(report)
    assert sum(line.startswith("(g) tiny ") for line in lines) == 2
    assert any("(fp8) not run" in line for line in lines)


def test_the_invariant_sections_token_check_runs_a_real_engine(tmp_path: Path) -> None:
    """Section (h)'s check on the CPU's default path (dummy weights, bf16): one prompt alone,
    then beside 15 others, on one engine; a bool either way. The section itself needs CUDA:
    on a CPU, --batch-invariant with bfloat16 is refused by name."""
    from load.gpu_engine_pairs import same_tokens_alone_and_batched

    torch.set_num_threads(1)
    folder = write_shape_folder(tmp_path / "tiny-shape", TINY)
    same = same_tokens_alone_and_batched(folder, "cpu", {}, TINY.vocab_size, output=3)
    assert isinstance(same, bool)
    with pytest.raises(ValueError, match="--batch-invariant"):
        gpu_bench.invariant_section(tmp_path, "cpu", TINY, requests=2, output=3)


def test_the_invariant_section_is_summarised_per_variant() -> None:
    run = {"single_stream": {"decode_tokens_per_s": 900.0}, "c64": {"output_tokens_per_s": 9e3}}
    section = {"shape": "smollm2-135m", "requests": 64, "runs": {"default": run, "invariant": run},
               "same_tokens_alone_and_batched": {"default": False, "invariant": True}}  # fmt: skip
    lines = summary_lines(build_report({"name": "a card"}, {"invariant": section}, 1.0, "x"))
    assert any(line.startswith("(h) smollm2-135m invariant:") and line.endswith("True")
               for line in lines)  # fmt: skip
    assert any(line.startswith("(h) smollm2-135m default:") and line.endswith("False")
               for line in lines)  # fmt: skip
