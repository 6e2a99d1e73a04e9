"""What ``--dtype auto`` runs: the weights' dtype and the GGUF block linears' activations.

Users compare defaults (llama.cpp quantizes activations by default, vLLM's CPU backend runs
bf16), so ``auto`` takes the fastest path whose effect on outputs is measured
(``load/numerics_check.py``, docs/benchmarks.md) on the CPU at hand:

1. bfloat16 with int8 activations on the GGUF blocks where the CPU has AVX512-VNNI or AVX-VNNI
   (integer dot products) and the model runs on its GGUF blocks with ``--gguf-activations int8``;
2. bfloat16 where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16);
3. float32 elsewhere: without native bf16, PyTorch's bf16 matmuls run several times slower
   than float32 (docs/engine-benchmark.md).

``--dtype float32`` (and ``--gguf-activations exact`` under bf16) stay for bit-exact work:
float32 is token for token what transformers produces. :func:`auto_cpu_numerics` is the rule,
pure, with the CPU's flags as an argument so every machine kind is testable here;
:func:`resolve_numerics` applies it to one engine's flags and device.
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
    and ``reason``, one sentence saying why (the flags given, or the CPU's features)."""

    dtype: str
    gguf_activations: str
    reason: str

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
                "gguf_activations": self.gguf_activations, "reason": self.reason}  # fmt: skip


def auto_cpu_numerics(flags: frozenset[str], gguf_blocks: bool, activations: str) -> NumericsPath:
    """``--dtype auto`` on a CPU with ``flags`` (``/proc/cpuinfo``'s), for a model that runs
    on its GGUF blocks or not, under ``--gguf-activations`` ``activations``."""
    vnni = [f for f in VNNI_FLAGS if f in flags]
    bf16 = [f for f in BF16_FLAGS if f in flags]
    if vnni and gguf_blocks and activations == "int8":
        return NumericsPath(
            "bfloat16", "int8",
            f"--dtype auto: the CPU has {', '.join(vnni + bf16)}: bf16 with int8 activations "
            "on the GGUF blocks (--dtype float32 for bit-exact outputs)",
        )  # fmt: skip
    if bf16:
        why = "no GGUF blocks to quantize" if not gguf_blocks else (
            "--gguf-activations exact" if activations != "int8" else "no VNNI for int8"
        )  # fmt: skip
        return NumericsPath(
            "bfloat16", "exact",
            f"--dtype auto: the CPU has {', '.join(bf16)} (native bf16), {why} "
            "(--dtype float32 for bit-exact outputs)",
        )  # fmt: skip
    missing = "no native bf16 (avx512_bf16, amx_bf16)"
    if not vnni:
        missing += " and no VNNI (avx512_vnni, avx_vnni)"
    return NumericsPath("float32", "exact", f"--dtype auto: the CPU has {missing}")


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
) -> NumericsPath:
    """The path for ``--dtype`` ``dtype`` on ``device``: ``auto`` on CPU by
    :func:`auto_cpu_numerics`, bfloat16 on CUDA; a named dtype as given (int8 activations
    only under bfloat16 on GGUF blocks, as the loader applies them)."""
    if dtype == "auto" and device.type == "cpu":
        return auto_cpu_numerics(flags(), gguf_blocks, gguf_activations)
    if dtype == "auto":
        dtype, reason = "bfloat16", f"--dtype auto on {device.type}"
    else:
        reason = f"--dtype {dtype}"
    int8 = gguf_activations == "int8" and dtype == "bfloat16" and gguf_blocks
    if dtype == "bfloat16" and gguf_blocks:
        reason += f", --gguf-activations {gguf_activations}"
    return NumericsPath(dtype, "int8" if int8 else "exact", reason)
