"""The KV cache's element type (``--kv-cache-dtype``, vLLM's flag and values) and its layout.

``auto`` stores K/V in the model's dtype, except on the default CPU path (``--dtype auto`` on
GGUF blocks), where it stores float16 (``engine.numerics``: ``NumericsPath.auto_kv``).

``int8`` halves the bytes a decode step reads from a bf16 cache: each (token, KV head) row
holds its ``head_dim`` values rounded to int8 and, in the row's last 4 bytes, their float32
scale (``max |x| / 127``), so the tensor is int8
``[2, num_blocks, block_size, kv_heads, head_dim + 4]``. The scale is per (token, head), not per
block: a token's row is final when written (a per-block scale would have to re-quantize the
block's earlier rows whenever a larger value arrives, and a block shared by a cached prefix
would change under its readers), and because it lives inside the row, everything that copies
blocks (swap, prefix sharing, a tensor-parallel rank's head shard) carries the scales without
knowing they exist. The price is 4 bytes per row: ~6% of the int8 row at head_dim 64.

``float16`` stores IEEE half precision: the same bytes as bf16 with three more bits of
mantissa (values beyond +-65504 become inf). Under the float32 path (``--dtype auto`` on a GGUF
model, or ``float32``) it halves the bytes a decode step's attention reads from the float32
cache; each value is rounded to nearest even once, when written, and every step reads it back
the same way, so the cache's contents (and so a request's tokens) do not depend on the batch or
on the prefix cache. The native CPU kernels read it with float32 queries (the AVX-512 and AVX2
passes with ``vcvtph2ps``, the portable ones in C); other pairings run the PyTorch reference.

``fp8_e4m3`` stores ``float8_e4m3fn`` values with scale 1 (vLLM's default without calibrated
scales), values beyond +-448 saturated; the PyTorch reference writes it and reads it on every
device, except CUDA decode steps on sm 8.9+, which read it in the split-K Triton kernel
(``triton_decode_attention.py``); the native CPU kernels do not (docs/configuration.md).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3")
INT8_SCALE_BYTES = 4  # the float32 scale at the end of each int8 row
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value


def storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache tensor for ``--kv-cache-dtype name`` under a model of
    ``model_dtype``; ValueError naming the flag for an unknown name or an fp8 cache on a torch
    without float8."""
    if name == "auto":
        return model_dtype
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float16":
        return torch.float16
    if name == "float32":
        return torch.float32
    if name == "int8":
        return torch.int8
    if name == "fp8_e4m3":
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is None:
            raise ValueError("--kv-cache-dtype fp8_e4m3 needs a torch with float8_e4m3fn")
        return fp8  # type: ignore[no-any-return]
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one (token, KV head) row in a cache of ``dtype``."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_shape(
    dtype: torch.dtype, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """One layer's cache tensor shape: ``[2 (K, V), blocks, block_size, kv_heads, row]``;
    ValueError for an int8 cache whose rows would not keep their float32 scales aligned."""
    if dtype == torch.int8 and head_dim % 4:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim a multiple of 4, got {head_dim}")
    return (2, num_blocks, block_size, kv_heads, row_width(dtype, head_dim))


def bytes_per_token_head(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one K (or V) row of one token and KV head."""
    return row_width(dtype, head_dim) * torch.empty(0, dtype=dtype).element_size()
