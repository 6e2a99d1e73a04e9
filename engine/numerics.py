"""What ``--dtype auto`` runs: the weights' dtype and the GGUF block linears' activations.

On CPU, ``auto`` is float32 on the GGUF file's own Q4_1/Q8_0 blocks, on every kind of CPU:
every linear of every step, whatever its number of rows, runs the one batch invariant block
kernel (``csrc/panel_linear.c``: a fixed chain of float32 operations per output element), and
attention, norms and the LM head compute each row alone in a fixed order. A request's greedy
tokens then do not depend on the prefix cache, on the other requests in its steps, on the
chunk size, on speculation or on the thread count (docs/numerics.md). The kernel reads the
file's 4.5/8.5-bit blocks, so one-stream decode keeps the speed of a quantized engine, and its
products are the float32 model's.

bfloat16 (``--dtype bfloat16``) and int8 activations (``--gguf-activations int8`` under it) stay
as opt-ins: faster on CPUs with bf16 or VNNI units for big batches, but their kernels are chosen
by a step's size, so a reply can change with the load. They are no longer the default: on an
AVX-512 VNNI machine the default replies changed when their prompt was cached (issue 42).
:func:`auto_cpu_numerics` is the rule, pure, with the CPU's flags as an argument so every
machine kind is testable here; :func:`resolve_numerics` applies it to one engine's flags and
device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# /proc/cpuinfo flags: integer dot products the int8 kernels use, and bf16 arithmetic.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NumericsPath:
    """How one engine computes: ``dtype`` of weights and activations, ``gguf_activations``
    (``int8``: the GGUF block linears round their inputs to int8 per 32 values; ``exact``),
    ``reason``, one sentence saying why (the flags given, or the CPU's features), and
    ``batch_invariant``: whether a request's tokens are independent of the rest of its steps
    (float32 on GGUF blocks on CPU: every step on the panel kernel; dense float32 matmuls are
    MKL's, whose bits may depend on the number of rows); ``auto_kv``: what ``--kv-cache-dtype
    auto`` stores on this path (``auto``: the model's dtype; the default CPU path: float16,
    half the bytes a decode step's attention reads, each value rounded once when written)."""

    dtype: str
    gguf_activations: str
    reason: str
    batch_invariant: bool = False
    auto_kv: str = "auto"

    def kv_cache_dtype(self, flag: str) -> str:
        """``--kv-cache-dtype`` ``flag`` as this path stores it: ``auto`` resolved to
        :attr:`auto_kv`, any other value as given."""
        return self.auto_kv if flag == "auto" else flag

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def name(self) -> str:
        """``bfloat16+int8``, ``bfloat16`` or ``float32``: load/numerics_check.py's names."""
        return f"{self.dtype}+int8" if self.gguf_activations == "int8" else self.dtype

    def as_dict(self) -> dict[str, Any]:
        """What ``/v1/models`` shows on the base model's card."""
        return {"path": self.name, "dtype": self.dtype,
                "gguf_activations": self.gguf_activations, "reason": self.reason,
                "batch_invariant": self.batch_invariant,
                "kv_cache_auto": self.auto_kv}  # fmt: skip


def auto_cpu_numerics(flags: frozenset[str], gguf_blocks: bool, activations: str) -> NumericsPath:
    """``--dtype auto`` on a CPU with ``flags`` (``/proc/cpuinfo``'s), for a model that runs
    on its GGUF blocks or not, under ``--gguf-activations`` ``activations``: float32 on every
    CPU (the reason names the faster opt-ins the CPU has, and why they are not the default)."""
    fast = [f for f in (*VNNI_FLAGS, *BF16_FLAGS) if f in flags]
    opt_in = (
        f"; the CPU has {', '.join(fast)}: --dtype bfloat16 is faster for big batches, "
        "not batch invariant"
        if fast
        else ""
    )
    if not gguf_blocks:
        return NumericsPath(
            "float32", "exact",
            f"--dtype auto: float32, dense (no GGUF blocks; not batch invariant){opt_in}",
        )  # fmt: skip
    del activations  # int8 activations apply under bfloat16 only, an opt-in
    return NumericsPath(
        "float32", "exact",
        f"--dtype auto: float32 on the GGUF blocks, batch invariant, float16 KV cache{opt_in}",
        True, "float16",
    )  # fmt: skip


def cpu_flags() -> frozenset[str]:
    """This CPU's ``/proc/cpuinfo`` flags (empty where there is no such file)."""
    from engine.kernels.cpu import cpu_flags as probe

    return probe()


def resolve_numerics(
    dtype: str,
    gguf_activations: str,
    device: torch.device,
    gguf_blocks: bool,
    flags: Callable[[], frozenset[str]] = cpu_flags,
    triton_invariant: bool = False,
) -> NumericsPath:
    """The path for ``--dtype`` ``dtype`` on ``device``: ``auto`` on CPU by
    :func:`auto_cpu_numerics`, bfloat16 on CUDA; a named dtype as given (int8 activations
    only under bfloat16 on GGUF blocks, as the loader applies them). ``triton_invariant``:
    ``--batch-invariant`` on the CUDA kernels (engine.kernels.triton_invariant)."""
    if triton_invariant:
        name = "bfloat16" if dtype == "auto" else dtype
        reason = f"--dtype {dtype} on the CUDA kernels, --batch-invariant: batch invariant Triton"
        return NumericsPath(name, "exact", reason + " matmuls, norms and attention", True)
    if dtype == "auto" and device.type == "cpu":
        return auto_cpu_numerics(flags(), gguf_blocks, gguf_activations)
    if dtype == "auto":
        dtype, reason = "bfloat16", f"--dtype auto on {device.type}"
    else:
        reason = f"--dtype {dtype}"
    invariant = dtype == "float32" and gguf_blocks and device.type == "cpu"
    if invariant:
        reason += " on the GGUF blocks, batch invariant"
    int8 = gguf_activations == "int8" and dtype == "bfloat16" and gguf_blocks
    if dtype == "bfloat16" and gguf_blocks:
        reason += f", --gguf-activations {gguf_activations}"
    return NumericsPath(dtype, "int8" if int8 else "exact", reason, invariant)


def refuse_uncovered_invariance(config: Any, quantization: str) -> None:
    """ValueError naming each flag of ``config`` (an EngineConfig) that ``--batch-invariant`` on
    the CUDA kernels does not cover: those parts run kernels whose bits follow the step's shape."""
    uncovered = []
    if quantization == "fp8":
        uncovered.append("--quantization fp8 (PyTorch's scaled matmul)")
    if config.kv_cache_dtype == "fp8_e4m3":
        uncovered.append("--kv-cache-dtype fp8_e4m3 (read by PyTorch's attention)")
    if config.enable_lora:
        uncovered.append("--enable-lora (the adapters' batched matmuls)")
    if uncovered:
        raise ValueError(
            "--batch-invariant on CUDA does not cover "
            + "; ".join(uncovered)
            + " (docs/numerics.md)"
        )
