"""Triton kernels: scatter this step's K/V rows into the paged cache by ``slot_mapping``.

Twins of :func:`engine.kernels.reference.write_kv_cache_ref` (same signature, same result).
One program per new token copies its ``kv_heads * head_dim`` key and value elements; into an
int8 cache (:mod:`engine.kv_cache_dtype`) it quantizes each head's row and stores the row's
float32 scale after its values, rounding as the reference does (ties to even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# x + 1.5 * 2**23 - 1.5 * 2**23 rounds a float32 |x| < 2**22 to an integer, ties to even (the
# interpreter has no rint; the GPU rounds the same way).
_ROUNDER: tl.constexpr = tl.constexpr(12582912.0)


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


@triton.jit
def _quantize_rows(x, scale_ok, scale):
    safe = tl.where(scale_ok, scale, 1.0)
    q = tl.math.div_rn(x, safe[:, None])
    q = (q + _ROUNDER) - _ROUNDER
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    return tl.where(scale_ok[:, None], q, 0.0).to(tl.int8)


@triton.jit
def _write_kv_int8_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,  # int8 [2, blocks, block_size, kv_heads, HEAD_DIM + 4]
    scale_ptr,  # the same memory as float32 (row / 4 elements per row)
    slot_ptr,
    key_stride,
    value_stride,
    v_offset,  # bytes from the K half of the cache to its V half
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    src = heads[:, None] * HEAD_DIM + dims[None, :]
    row = HEAD_DIM + 4
    rows = (slot * KV_HEADS + heads) * row  # byte offset of each head's row
    for half in tl.static_range(2):
        if half == 0:
            x = tl.load(key_ptr + token * key_stride + src, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(value_ptr + token * value_stride + src, mask=mask, other=0.0).to(tl.float32)
        scale = tl.max(tl.abs(x), axis=1) / 127.0
        q = _quantize_rows(x, scale > 0.0, scale)
        base = half * v_offset
        tl.store(cache_ptr + base + rows[:, None] + dims[None, :], q, mask=mask)
        tl.store(scale_ptr + (base + rows + HEAD_DIM) // 4, scale, mask=heads < KV_HEADS)


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
    if kv_cache.dtype == torch.int8:
        _write_kv_int8_kernel[(tokens,)](
            key,
            value,
            kv_cache,
            kv_cache.view(torch.float32),
            slot_mapping,
            key.stride(0),
            value.stride(0),
            kv_cache.stride(0),
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
        return
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
