"""Triton kernel: scatter this step's K/V rows into the paged cache by ``slot_mapping``.

Twin of :func:`engine.kernels.reference.write_kv_cache_ref` (same signature, same result).
One program per new token copies its ``kv_heads * head_dim`` key and value elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    key_stride,  # elements between consecutive tokens of key (rows are [kv_heads * d] dense)
    value_stride,
    v_offset,  # elements from the K half of the cache to its V half
    ROW: tl.constexpr,  # kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two >= ROW
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    k = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    v = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    dst = cache_ptr + slot * ROW + cols
    tl.store(dst, k, mask=mask)
    tl.store(dst + v_offset, v, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ([T, kv_heads, d]) into ``kv_cache`` at ``slot_mapping``."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    row = kv_heads * head_dim
    # Heads and head_dim must be dense within a token; tokens may be strided (views of qkv).
    key = key if key.stride()[1:] == (head_dim, 1) else key.contiguous()
    value = value if value.stride()[1:] == (head_dim, 1) else value.contiguous()
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    _write_kv_kernel[(tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
