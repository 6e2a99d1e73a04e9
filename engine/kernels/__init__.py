"""The engine's kernel front door: every op the models and the runner call, by name.

Which implementation serves an op is decided here and only here, once per device type
(:func:`choose`): Triton on CUDA, the native C kernels of :mod:`engine.kernels.cpu` on a CPU
where they built (their instruction sets detected on the running CPU, never assumed), the
PyTorch references of :mod:`engine.kernels.reference` otherwise. Models never test a tensor's
device: they call :func:`add_rms_norm`, :func:`rope_write_kv`, :func:`paged_attention`,
:func:`quantized_linear`, :func:`prepacked_linear`... and get the chosen implementation. A
native kernel may still decline inputs it does not handle (a dtype, a shape limit); the op then
runs the reference, with the same meaning.

Triton is imported only when a CUDA tensor arrives, so a CPU process never pays for it (and
tests can set ``TRITON_INTERPRET=1`` before the first import). Tests and benches may make every
device take CUDA's choice (``PORTICO_KERNEL_DEVICE=cuda``, read by :func:`choose`): the whole
engine then runs the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``.

No submodule here may share a name with an op the package exports: importing
``engine.kernels.<name>`` binds the module to the package's attribute ``<name>``, replacing
the function (the CUDA path's crash of issue 40). The Triton kernels live in ``triton_*.py``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kernels import cpu
from engine.kernels.reference import (
    add_rms_norm_ref,
    paged_attention_ref,
    rms_norm_ref,
    rope_write_kv_ref,
    write_kv_cache_ref,
)

if TYPE_CHECKING:
    from engine.models.rotary import RopeAngles

# Up to this many rows a oneDNN-prepacked bf16 weight beats F.linear (which reorders the weight
# for the matrix units on every call): 25-35% faster at 16-256 rows on AMX, a little slower
# at 2048 (docs/engine-benchmark.md).
PACKED_MAX_ROWS = 512

# Set to "cuda" before the first op runs, every tensor takes CUDA's kernel choice: the tests'
# and benches' way to run the CUDA path on CPU tensors. Never set in production; read by choose().
KERNEL_DEVICE_ENV = "PORTICO_KERNEL_DEVICE"


@dataclass(frozen=True)
class KernelChoice:
    """Which implementation serves each op on one device type.

    Values: ``"triton"``, ``"cpu"`` (native C), ``"onednn"`` (torch's prepacked bf16 matmul),
    ``"float32"`` (a float32 copy of bf16 weights, for CPUs without bf16 arithmetic),
    ``"reference"`` (PyTorch ops) or ``"none"`` (the op is not offered: callers use the dense
    path). ``features`` are the CPU instruction sets the native kernels were built with.
    """

    device_type: str
    write_kv_cache: str
    paged_attention: str
    rope_write_kv: str
    add_rms_norm: str
    quantized_linear: str
    prepacked_linear: str
    features: frozenset[str] = frozenset()


@functools.cache
def choose(device_type: str) -> KernelChoice:
    """The implementation of every op on ``device_type`` ("cpu", "cuda", ...), decided once.

    ``PORTICO_KERNEL_DEVICE`` (:data:`KERNEL_DEVICE_ENV`), where set, replaces ``device_type``.
    """
    forced = os.environ.get(KERNEL_DEVICE_ENV, "")
    if forced:
        if forced != "cuda":
            raise ValueError(f"{KERNEL_DEVICE_ENV} may only be 'cuda', not {forced!r}")
        device_type = forced
    if device_type == "cuda":
        return KernelChoice("cuda", "triton", "triton", "reference", "reference", "none", "none")
    native = "cpu" if device_type == "cpu" and cpu.available() else "reference"
    if device_type != "cpu":
        prepacked = "none"
    elif not cpu.bf16_matmul_native():
        prepacked = "float32"
    elif torch.backends.mkldnn.is_available():
        prepacked = "onednn"
    else:
        prepacked = "none"
    return KernelChoice(
        device_type,
        write_kv_cache="reference",
        paged_attention=native,
        rope_write_kv=native,
        add_rms_norm=native,
        quantized_linear="cpu" if native == "cpu" else "none",
        prepacked_linear=prepacked,
        features=cpu.compiled_features() if native == "cpu" else frozenset(),
    )


def _choice(t: torch.Tensor) -> KernelChoice:
    # is_cpu first: Tensor.device.type formats the device's name through a C++ string stream
    # (0.5 us a call warm, several after a step has flushed the caches; every op asks)
    return choose("cpu" if t.is_cpu else t.device.type)


_batch_invariant = False


def set_batch_invariant(on: bool) -> None:
    """``--batch-invariant`` on the CUDA kernel choice: linears, RMSNorms and attention take
    kernels whose every row is computed the same way whatever the step holds
    (:mod:`engine.kernels.triton_invariant`). Set once, before the model runs; the CPU choice
    ignores it (its default path is invariant already)."""
    global _batch_invariant
    _batch_invariant = on


def batch_invariant() -> bool:
    return _batch_invariant


def _invariant_triton(t: torch.Tensor) -> bool:
    return _batch_invariant and _choice(t).device_type == "cuda"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: the batch invariant Triton matmul under
    :func:`set_batch_invariant` on the CUDA choice, else ``F.linear``."""
    if _invariant_triton(x) and x.dtype == weight.dtype:
        from engine.kernels import triton_invariant

        return triton_invariant.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _fp8(kv_cache: torch.Tensor) -> bool:
    """An fp8_e4m3 cache: only the references read and write it (engine.kv_cache_dtype)."""
    return kv_cache.dtype.itemsize == 1 and kv_cache.dtype != torch.int8


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into the paged cache (see :func:`write_kv_cache_ref`)."""
    if _choice(key).write_kv_cache == "triton" and not _fp8(kv_cache):
        from engine.kernels.triton_kv_cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        write_kv_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_lens_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """Causal attention over the paged cache (see :func:`paged_attention_ref`)."""
    args = (query, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    impl = _choice(query).paged_attention
    # pure decode: split-K, whose split count follows the batch's size (not under
    # --batch-invariant: the general kernel walks every query's context the same way)
    if impl == "triton" and max(query_lens_cpu, default=0) == 1 and not _batch_invariant:
        from engine.kernels import triton_decode_attention as decode

        if decode.serves(kv_cache):
            return decode.decode_attention_triton(query, kv_cache, block_tables, seq_lens, scale)
    impl = "reference" if _fp8(kv_cache) else impl
    if impl == "triton":
        from engine.kernels.triton_paged_attention import paged_attention_triton

        return paged_attention_triton(*args, query_lens_cpu, seq_lens_cpu)
    if impl == "cpu":
        out = cpu.paged_attention_cpu(*args)
        if out is not None:
            return out
    return paged_attention_ref(*args, query_lens_cpu, seq_lens_cpu)


def decode_attention_capturable(kv_cache: torch.Tensor) -> bool:
    """Whether a pure-decode step's attention over ``kv_cache`` reads only device tensors (the
    split-K Triton kernel serves it), so a CUDA graph may capture it; the other paths read the
    step's host-side lengths, which a replay would not update (an fp8 cache before sm 8.9)."""
    if choose(kv_cache.device.type).paged_attention != "triton":
        return False
    from engine.kernels import triton_decode_attention as decode

    return decode.serves(kv_cache)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm of ``x`` times ``weight`` (see :func:`rms_norm_ref`)."""
    if _invariant_triton(x):
        from engine.kernels import triton_invariant

        return triton_invariant.add_rms_norm(x, None, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    native_float32: bool = False,
) -> torch.Tensor:
    """``x += delta`` in place (the residual stream), then :func:`rms_norm` of ``x``.

    bfloat16 runs both in one native kernel where chosen; float32 too with ``native_float32``
    (the batch invariant path, whose fused step calls the same kernel: the same bits either
    way); otherwise float32 keeps PyTorch's ops, whose results the tests compare with
    transformers bit for bit.
    """
    if _invariant_triton(x):
        from engine.kernels import triton_invariant

        return triton_invariant.add_rms_norm(x, delta, weight, eps)
    native = x.dtype == torch.bfloat16 or (native_float32 and x.dtype == torch.float32)
    if native and _choice(x).add_rms_norm == "cpu":
        out = cpu.add_rms_norm_cpu(x, delta, weight, eps)
        if out is not None:
            return out
    return add_rms_norm_ref(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` ([T, 2 * intermediate], gate first). float32
    runs the native kernel where chosen: each element by the same code wherever it sits, so a
    row's values do not depend on the step's size or threads (batch invariance)."""
    if gate_up.dtype == torch.float32 and _choice(gate_up).add_rms_norm == "cpu":
        out = cpu.silu_mul_cpu(gate_up, intermediate)
        if out is not None:
            return out
    gate, up = gate_up.split(intermediate, dim=-1)
    # In place on the fresh matmul output: two fewer [T, intermediate] allocations.
    return F.silu(gate, inplace=True).mul_(up)


def rope_write_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: RopeAngles,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate the query and key heads of ``qkv`` ([T, (heads + 2 kv_heads) * d]) with RoPE,
    store the keys and values in ``kv_cache`` at ``slot_mapping``; returns the rotated queries
    ``[T, heads, d]`` (see :func:`rope_write_kv_ref`)."""
    if _choice(qkv).rope_write_kv == "cpu" and cpu.rope_write_kv_cpu(
        qkv, num_heads, num_kv_heads, head_dim, rope.cos_table, rope.sin_table,
        rope.positions, kv_cache, slot_mapping,
    ):  # fmt: skip
        # Rotated in place and cached in one native call; queries are a view of the qkv rows.
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    q, k, v = rope_write_kv_ref(qkv, num_heads, num_kv_heads, head_dim, rope.cos, rope.sin)
    write_kv_cache(k, v, kv_cache, slot_mapping)
    return q


def quantized_linear(
    x: torch.Tensor,
    kind: str,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    packed_q8: torch.Tensor | None = None,
    panels: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for W in GGUF blocks (:func:`cpu.quantized_linear`), or ``None``
    where no block kernel serves these inputs (the caller then uses the dense weight).
    ``packed_q8`` (:func:`pack_blocks_q8`): bfloat16 ``x`` is rounded to int8 per block of 32
    and runs the integer kernel (not exact). ``panels`` (GGUFBlocks.pack_panels): the batch
    invariant kernel (:func:`cpu.panel_linear`)."""
    if _choice(x).quantized_linear != "cpu":
        return None
    return cpu.quantized_linear(x, kind, qs, scales, mins, bias, packed_q8, panels)


def pack_blocks_q8(
    kind: str, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
) -> torch.Tensor | None:
    """GGUF blocks repacked for the int8-activation kernel (:func:`cpu.pack_blocks_q8`), or
    None where no such kernel serves them (another device, neither AVX512-VNNI nor AVX2, odd
    sizes)."""
    if choose("cpu").quantized_linear != "cpu":
        return None
    return cpu.pack_blocks_q8(kind, qs, scales, mins)


def prepack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered once for :func:`prepacked_linear` (oneDNN's bf16 matmul on CPU), or
    copied to float32 on a CPU without bf16 arithmetic (where PyTorch's bf16 matmul converts
    every operand on every call: 5x slower than float32 on an AVX2 EPYC); None where neither is
    offered (another dtype or device, a torch built without oneDNN)."""
    if weight.dtype != torch.bfloat16:
        return None
    kind = choose(weight.device.type).prepacked_linear
    if kind == "float32":
        return weight.detach().float()
    if kind != "onednn":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except (RuntimeError, AttributeError):  # an op this torch build lacks
        return None


def prepacked_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """``x @ W.T + bias`` through a weight from :func:`prepack_linear_weight`; ``None`` for
    inputs the packed path does not serve (not bf16, empty, or over :data:`PACKED_MAX_ROWS`
    for a oneDNN weight). A float32 copy serves every step: float32 products and sums, rounded
    to bf16 once, as oneDNN's bf16 matmul rounds its float32 sums."""
    if x.dtype != torch.bfloat16 or x.shape[0] == 0:
        return None
    if packed.dtype == torch.float32:
        wide = F.linear(x.float(), packed, bias.float() if bias is not None else None)
        return wide.to(torch.bfloat16)
    if x.shape[0] > PACKED_MAX_ROWS:
        return None
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    out: torch.Tensor = linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out


__all__ = [
    "KERNEL_DEVICE_ENV",
    "PACKED_MAX_ROWS",
    "KernelChoice",
    "add_rms_norm",
    "batch_invariant",
    "choose",
    "decode_attention_capturable",
    "paged_attention",
    "pack_blocks_q8",
    "paged_attention_ref",
    "prepack_linear_weight",
    "prepacked_linear",
    "quantized_linear",
    "linear",
    "rms_norm",
    "rope_write_kv",
    "set_batch_invariant",
    "silu_mul",
    "write_kv_cache",
    "write_kv_cache_ref",
]
