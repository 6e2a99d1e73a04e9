"""``--dtype auto``'s rule on every kind of machine (engine/numerics.py), the flags that keep
outputs bit-exact, and the CPU probe the engine feeds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import cpu
from engine.llm_engine import LLMEngine
from engine.model_loader import resolve_quantization
from engine.numerics import auto_cpu_numerics, resolve_numerics
from portico.registry import resolve

# /proc/cpuinfo flags of the machine kinds the rule tells apart (vector flags only).
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
CASCADE_LAKE = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})  # VNNI, no bf16
ALDER_LAKE = frozenset({"avx2", "fma", "avx_vnni"})  # AVX-VNNI without AVX-512
ZEN2 = frozenset({"avx2", "fma"})
NO_FLAGS: frozenset[str] = frozenset()


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4, CASCADE_LAKE, ALDER_LAKE])
def test_vnni_cpus_run_gguf_blocks_in_bf16_with_int8_activations(flags: frozenset[str]) -> None:
    path = auto_cpu_numerics(flags, gguf_blocks=True, activations="int8")
    assert (path.dtype, path.gguf_activations, path.name) == ("bfloat16", "int8", "bfloat16+int8")
    assert any(f in path.reason for f in ("avx512_vnni", "avx_vnni"))


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4])
def test_native_bf16_cpus_run_bf16_without_gguf_blocks_or_with_exact_activations(
    flags: frozenset[str],
) -> None:
    dense = auto_cpu_numerics(flags, gguf_blocks=False, activations="int8")
    exact = auto_cpu_numerics(flags, gguf_blocks=True, activations="exact")
    for path in (dense, exact):
        assert (path.dtype, path.gguf_activations) == ("bfloat16", "exact")
        assert "avx512_bf16" in path.reason
    assert "no GGUF blocks" in dense.reason and "--gguf-activations exact" in exact.reason


@pytest.mark.parametrize("flags", [CASCADE_LAKE, ALDER_LAKE, ZEN2, NO_FLAGS])
def test_cpus_without_native_bf16_stay_float32_unless_int8_applies(flags: frozenset[str]) -> None:
    """Without native bf16, bf16 pays off only through the int8 block linears: a dense model
    or exact activations get float32 (bf16 matmuls emulated run several times slower)."""
    for gguf_blocks, activations in ((False, "int8"), (True, "exact")):
        path = auto_cpu_numerics(flags, gguf_blocks, activations)
        assert (path.dtype, path.gguf_activations) == ("float32", "exact")
        assert "no native bf16" in path.reason
    if not {"avx512_vnni", "avx_vnni"} & flags:
        assert auto_cpu_numerics(flags, True, "int8").dtype == "float32"


def test_named_dtypes_are_kept_whatever_the_cpu() -> None:
    def every_flag() -> frozenset[str]:
        return SAPPHIRE_RAPIDS

    cpu_device = torch.device("cpu")
    exact = resolve_numerics("float32", "int8", cpu_device, True, every_flag)
    assert (exact.dtype, exact.gguf_activations, exact.reason) == (
        "float32",
        "exact",
        "--dtype float32",
    )
    bf16 = resolve_numerics("bfloat16", "exact", cpu_device, True, every_flag)
    assert (bf16.dtype, bf16.gguf_activations) == ("bfloat16", "exact")
    int8 = resolve_numerics("bfloat16", "int8", cpu_device, True, lambda: NO_FLAGS)
    assert int8.name == "bfloat16+int8" and "--gguf-activations int8" in int8.reason
    assert (
        resolve_numerics("auto", "int8", torch.device("cuda"), False, every_flag).dtype
        == "bfloat16"
    )
    assert resolve_numerics("auto", "int8", cpu_device, True, lambda: ZEN2).dtype == "float32"


def test_the_probe_reads_this_cpus_flags() -> None:
    flags = cpu.cpu_flags()
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    assert flags == frozenset(line.split(":", 1)[1].split()) if line else flags == frozenset()
    assert cpu.cpu_features() <= flags


def test_an_engine_built_from_auto_flags_reports_the_path_the_rule_picks(
    smollm2_gguf: Path,
) -> None:
    """The default model through ``LLMEngine.from_config`` with no dtype flag: the engine's
    numerics are the rule's for this CPU, and its weights are in that dtype."""
    engine = LLMEngine.from_config(
        EngineConfig(model=str(smollm2_gguf), device="cpu", num_gpu_blocks_override=16)
    )
    try:
        source = resolve(str(smollm2_gguf))
        gguf_blocks = resolve_quantization("auto", source, "cpu") == "gguf"
        expected = auto_cpu_numerics(cpu.cpu_flags(), gguf_blocks, "int8")
        assert engine.numerics == expected
        assert engine.runner.model.model.embed_tokens.weight.dtype == expected.torch_dtype
    finally:
        engine.close()
