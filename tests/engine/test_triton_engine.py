"""The engine through the CUDA kernel choice, on a CPU (issue 40).

The Triton kernels are checked op by op in test_kernels.py; here the whole engine (loader,
scheduler, runner, sampler) runs through ``engine.kernels.choose("cuda")`` with Triton
interpreted on CPU tensors, in a separate process (``TRITON_INTERPRET`` must be set before
triton is first imported), and its greedy tokens must equal the CPU path's.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest
import torch

from engine import kernels
from tests.engine.cuda_choice import run_interpreted
from tests.engine.triton_engine_check import run_scenario

CHECK_SCRIPT = Path(__file__).with_name("triton_engine_check.py")


def test_no_kernel_module_shares_a_name_with_an_export() -> None:
    """Importing ``engine.kernels.<name>`` binds the module over the package's ``<name>``: a
    module named like an op replaces the op the models call (the crash of issue 40)."""
    modules = {m.name for m in pkgutil.iter_modules(kernels.__path__)}
    assert {"triton_paged_attention", "triton_kv_cache_write", "reference"} <= modules
    public = {n for n in dir(kernels) if not n.startswith("_")}
    exported = set(kernels.__all__) | {n for n in public if callable(getattr(kernels, n))}
    assert not modules & exported, sorted(modules & exported)


def test_forced_kernel_device_accepts_only_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels.choose.cache_clear()
    monkeypatch.setenv(kernels.KERNEL_DEVICE_ENV, "tpu")
    try:
        with pytest.raises(ValueError, match="PORTICO_KERNEL_DEVICE"):
            kernels.choose("cpu")
    finally:
        kernels.choose.cache_clear()


def test_engine_on_the_cuda_kernel_choice_matches_the_cpu_path(tiny_llama_dir: Path) -> None:
    """Prefill, decode, a cached prefix and a preemption, through the interpreted Triton
    kernels: the same greedy tokens as the CPU path's kernels."""
    triton = run_interpreted(CHECK_SCRIPT, str(tiny_llama_dir), timeout=600)
    assert triton["paged_attention"] == triton["write_kv_cache"] == "triton"
    assert triton["triton_modules"] == [  # decode steps run split-K, the others the general one
        "engine.kernels.triton_decode_attention",
        "engine.kernels.triton_kv_cache_write",
        "engine.kernels.triton_paged_attention",
    ]
    cpu = run_scenario(tiny_llama_dir)
    assert cpu["paged_attention"] != "triton" and cpu["triton_modules"] == []
    assert triton["num_preemptions"] > 0 and cpu["num_preemptions"] > 0
    assert all(n >= 32 for rid, n in triton["cached"].items() if rid != "first"), triton
    assert triton["cached"] == cpu["cached"]
    assert len(triton["tokens"]) == 5
    assert all(len(t) == 6 for t in triton["tokens"].values())
    assert triton["tokens"] == cpu["tokens"]
    for rid, steps in cpu["logprobs"].items():
        assert len(steps) == 6 and all(len(top) == 2 for top in steps)
        torch.testing.assert_close(triton["logprobs"][rid], steps, atol=1e-4, rtol=0)
