"""``--batch-invariant`` on the CUDA kernel choice (engine/kernels/triton_invariant.py).

Without a GPU the kernels and the whole engine run interpreted on CPU tensors, in a separate
process (``TRITON_INTERPRET`` must be set before triton is imported): what that can prove is
listed in docs/numerics.md ("On CUDA"); the gpu-marked tests check the rest on a card."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.numerics import resolve_numerics
from tests.engine.cuda_choice import run_interpreted

CHECK_SCRIPT = Path(__file__).with_name("batch_invariant_triton_check.py")


@pytest.mark.slow
def test_the_invariant_kernels_and_engine_interpreted(tiny_llama_dir: Path) -> None:
    found = run_interpreted(CHECK_SCRIPT, str(tiny_llama_dir))
    assert found["linear_float32_rows_aligned_equal"]
    assert found["linear_float32_max_error"] < 1e-5
    assert found["norm_float32_residual_equal"] and found["norm_float32_rows_invariant"]
    assert found["norm_float32_max_error"] < 1e-5
    assert found["path_batch_invariant"] and found["mode"] and found["attention"] == "triton"
    tokens = {name: found[name][0] for name in ("alone", "cached", "batched", "chunked")}
    assert len({tuple(t) for t in tokens.values()}) == 1 and len(tokens["alone"]) == 6, tokens
    # the prompt leads its batch: its rows sit where they sat alone, so even the interpreter's
    # matmul gives them the same bits (docs/numerics.md: rows moved within a tile may differ)
    assert found["batched"][1] == found["alone"][1]


@pytest.fixture
def forced_cuda_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    kernels.choose.cache_clear()
    monkeypatch.setenv(kernels.KERNEL_DEVICE_ENV, "cuda")
    yield
    kernels.choose.cache_clear()
    kernels.set_batch_invariant(False)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"enable_lora": True}, "--enable-lora"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3"),
    ],  # fmt: skip
)
def test_what_the_invariant_cuda_path_does_not_cover_is_refused(
    tiny_llama_dir: Path, forced_cuda_choice: None, flags: dict[str, object], named: str
) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", batch_invariant=True, **flags)
    with pytest.raises(ValueError, match=f"does not cover {named}"):
        LLMEngine.from_config(config)
    assert not kernels.batch_invariant()


def test_batch_invariance_with_tensor_parallelism_is_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match="--batch-invariant is not supported with --tensor"):
        EngineConfig(model="smollm2-135m", batch_invariant=True, tensor_parallel_size=2)


def test_the_invariant_triton_path_is_reported_invariant() -> None:
    path = resolve_numerics("auto", "int8", torch.device("cuda"), False, triton_invariant=True)
    assert path.batch_invariant and path.name == "bfloat16" and "--batch-invariant" in path.reason
    plain = resolve_numerics("auto", "int8", torch.device("cuda"), False)
    assert not plain.batch_invariant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_rows_anywhere_and_the_engine_keep_their_bits(tiny_llama_dir: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import batch_invariant_triton_check as check

    found = check.kernel_findings("cuda", (torch.float32, torch.bfloat16))
    for dtype in ("float32", "bfloat16"):
        assert found[f"linear_{dtype}_rows_aligned_equal"]
        assert found[f"linear_{dtype}_rows_shifted_equal"]
        assert found[f"norm_{dtype}_rows_invariant"]
    try:
        runs = check.engine_findings(tiny_llama_dir, device="cuda", dtype="bfloat16")
    finally:
        kernels.set_batch_invariant(False)
    assert runs["path_batch_invariant"]
    for name in ("cached", "batched", "chunked"):
        assert runs[name] == runs["alone"], name
