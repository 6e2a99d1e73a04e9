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


EVERY_KIND = [SAPPHIRE_RAPIDS, ZEN4, CASCADE_LAKE, ALDER_LAKE, ZEN2, NO_FLAGS]


@pytest.mark.parametrize("flags", EVERY_KIND)
def test_every_cpu_runs_gguf_blocks_in_float32_batch_invariant(flags: frozenset[str]) -> None:
    """The default is the same batch invariant path on every kind of CPU, whatever
    --gguf-activations says (int8 applies under an explicit --dtype bfloat16 only)."""
    for activations in ("int8", "exact"):
        path = auto_cpu_numerics(flags, gguf_blocks=True, activations=activations)
        assert (path.dtype, path.gguf_activations, path.name) == ("float32", "exact", "float32")
        assert path.batch_invariant and "batch invariant" in path.reason
        assert path.as_dict()["batch_invariant"] is True


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, ZEN4, CASCADE_LAKE, ALDER_LAKE])
def test_cpus_with_bf16_or_vnni_name_the_faster_opt_in_and_its_cost(flags: frozenset[str]) -> None:
    path = auto_cpu_numerics(flags, gguf_blocks=True, activations="int8")
    assert "--dtype bfloat16" in path.reason and "not batch invariant" in path.reason
    assert any(f in path.reason for f in ("avx512_vnni", "avx_vnni", "avx512_bf16"))
    plain = auto_cpu_numerics(ZEN2, gguf_blocks=True, activations="int8")
    assert "--dtype bfloat16" not in plain.reason


def test_a_model_without_gguf_blocks_is_float32_and_not_claimed_invariant() -> None:
    """Dense float32 matmuls are MKL's, which promises no bits across row counts."""
    path = auto_cpu_numerics(ZEN2, gguf_blocks=False, activations="int8")
    assert (path.dtype, path.gguf_activations) == ("float32", "exact")
    assert not path.batch_invariant and "not batch invariant" in path.reason


def test_named_dtypes_are_kept_whatever_the_cpu() -> None:
    def every_flag() -> frozenset[str]:
        return SAPPHIRE_RAPIDS

    cpu_device = torch.device("cpu")
    exact = resolve_numerics("float32", "int8", cpu_device, True, every_flag)
    assert (exact.dtype, exact.gguf_activations, exact.batch_invariant) == (
        "float32",
        "exact",
        True,
    )
    assert exact.reason == "--dtype float32 on the GGUF blocks, batch invariant"
    bf16 = resolve_numerics("bfloat16", "exact", cpu_device, True, every_flag)
    assert (bf16.dtype, bf16.gguf_activations) == ("bfloat16", "exact")
    assert not bf16.batch_invariant
    int8 = resolve_numerics("bfloat16", "int8", cpu_device, True, lambda: NO_FLAGS)
    assert int8.name == "bfloat16+int8" and "--gguf-activations int8" in int8.reason
    assert not resolve_numerics("float32", "exact", cpu_device, False, every_flag).batch_invariant
    assert (
        resolve_numerics("auto", "int8", torch.device("cuda"), False, every_flag).dtype
        == "bfloat16"
    )
    assert resolve_numerics("auto", "int8", cpu_device, True, lambda: ZEN2).dtype == "float32"
    cuda = resolve_numerics("auto", "int8", torch.device("cuda"), False, every_flag)
    assert not cuda.batch_invariant


@pytest.mark.parametrize("flags", [{"dtype": "bfloat16"}, {"quantization": "none"}])
def test_batch_invariant_flag_refuses_to_start_on_a_path_that_is_not(
    smollm2_gguf: Path, flags: dict[str, str]
) -> None:
    """``--batch-invariant`` with a bf16 opt-in or dense matmuls: a ValueError naming the flag
    and the path, before any weight is loaded."""
    config = EngineConfig(model=str(smollm2_gguf), device="cpu", batch_invariant=True, **flags)
    with pytest.raises(ValueError, match="--batch-invariant: .* is not batch invariant"):
        LLMEngine.from_config(config)


def test_batch_invariant_flag_is_a_cli_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args(["--batch-invariant"])).batch_invariant
    assert not EngineConfig.from_cli_args(parser.parse_args([])).batch_invariant


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
        EngineConfig(
            model=str(smollm2_gguf), device="cpu", num_gpu_blocks_override=16,
            batch_invariant=True,
        )
    )  # fmt: skip
    try:
        source = resolve(str(smollm2_gguf))
        gguf_blocks = resolve_quantization("auto", source, "cpu") == "gguf"
        expected = auto_cpu_numerics(cpu.cpu_flags(), gguf_blocks, "int8")
        assert engine.numerics == expected and expected.batch_invariant  # the flag is met
        assert engine.runner.model.model.embed_tokens.weight.dtype == expected.torch_dtype
        # --kv-cache-dtype auto on the default path: a float16 cache, in every layer
        assert {c.dtype for c in engine.runner.kv_caches} == {torch.float16}
    finally:
        engine.close()


def test_kv_cache_auto_is_float16_on_the_default_path_only() -> None:
    """``--kv-cache-dtype auto`` stores float16 under ``--dtype auto`` on GGUF blocks (every
    CPU kind); the dense path and a named dtype keep the model's dtype; a named cache dtype
    is kept on every path."""
    for flags in EVERY_KIND:
        path = auto_cpu_numerics(flags, gguf_blocks=True, activations="exact")
        assert path.kv_cache_dtype("auto") == "float16" and "float16 KV cache" in path.reason
        assert path.as_dict()["kv_cache_auto"] == "float16"
        for named in ("float32", "bfloat16", "int8"):
            assert path.kv_cache_dtype(named) == named
        dense = auto_cpu_numerics(flags, gguf_blocks=False, activations="exact")
        assert dense.kv_cache_dtype("auto") == "auto"
    for dtype in ("float32", "bfloat16"):
        named = resolve_numerics(dtype, "exact", torch.device("cpu"), gguf_blocks=True)
        assert named.kv_cache_dtype("auto") == "auto"  # the model's dtype, as vLLM's auto
    cuda = resolve_numerics("auto", "exact", torch.device("cuda"), gguf_blocks=True)
    assert cuda.kv_cache_dtype("auto") == "auto"
