"""PyTorch references of the engine's kernels: the fallback path, and the tests' oracle.

Each function has the same meaning as its Triton or native twin in this package. They are
written for speed on CPU: no Python loop per token. All decoding requests (one new token each)
are served by batched attention: their contexts are gathered by block table into a padded
``[B, max_len, kv_heads, d]`` tensor and masked, B as large as keeps the gathered K/V within
~4 MiB (one op for a whole batch at short contexts). A request with several new tokens (a
prefill chunk) runs one ``scaled_dot_product_attention`` with a causal mask offset by the
context it already has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DECODE_CHUNK_BYTES = 4 << 20
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn value


def quantize_kv_int8_ref(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., d]`` as the int8 cache stores them: ``[..., d + 4]`` int8, the values
    ``round(x / scale)`` (ties to even) and then the float32 ``scale = max |x| / 127`` of the row
    as 4 bytes (:mod:`engine.kv_cache_dtype`). The native and Triton writers store the same."""
    wide = x.float()
    scale = wide.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale > 0, torch.round(wide / safe), torch.zeros_like(wide))
    q = q.clamp(-127, 127).to(torch.int8)
    return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)


def dequantize_kv_int8_ref(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., d + 4]`` int8 back to values ``[..., d]`` in ``dtype``."""
    scale = rows[..., -4:].contiguous().view(torch.float32)
    return (rows[..., :-4].float() * scale).to(dtype)


def to_cache_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V rows ``[..., d]`` in the cache's element type (and row layout, for int8)."""
    if cache_dtype == torch.int8:
        return quantize_kv_int8_ref(x)
    if cache_dtype.itemsize == 1:  # fp8_e4m3: saturate, as float8_e4m3fn has no infinity
        return x.float().clamp(-_FP8_MAX, _FP8_MAX).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back to K/V values in ``dtype`` (a view when the cache already is ``dtype``)."""
    if rows.dtype == dtype:
        return rows
    if rows.dtype == torch.int8:
        return dequantize_kv_int8_ref(rows, dtype)
    return rows.to(dtype)


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows ([T, kv_heads, d]) into ``kv_cache`` at ``slot_mapping``.

    ``kv_cache`` is ``[2, num_blocks, block_size, kv_heads, row]`` (0 = K, 1 = V), contiguous,
    ``row`` = d, or d + 4 for an int8 cache (:func:`quantize_kv_int8_ref`); slot ``s`` is block
    ``s // block_size``, offset ``s % block_size``.
    """
    _, num_blocks, block_size, kv_heads, row = kv_cache.shape
    flat = _bytes(kv_cache).view(2, num_blocks * block_size, kv_heads, row)
    flat[0].index_copy_(0, slot_mapping, _bytes(to_cache_rows(key, kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, _bytes(to_cache_rows(value, kv_cache.dtype)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor as uint8 (CPU torch has no index_copy_/index_select for float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _gather_context(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..ceil(length / block_size) * block_size - 1 of each table row,
    in ``dtype`` (an int8 or fp8 cache's rows are dequantized after the gather).

    Copies whole blocks (one contiguous row of ``block_size * kv_heads * row`` per block), which
    is about twice as fast on CPU as gathering token by token. Returns two
    ``[B, padded_len, kv_heads, d]`` tensors; positions past a request's length are garbage
    for the caller to mask.
    """
    _, num_blocks, block_size, kv_heads, row = kv_cache.shape
    num_ctx_blocks = -(-length // block_size)
    ids = block_tables[:, :num_ctx_blocks].reshape(-1).to(torch.int64)
    shape = (block_tables.shape[0], num_ctx_blocks * block_size, kv_heads, row)
    # K and V in one op: the cache is [2, num_blocks, ...], so select along the block dim.
    both = _bytes(kv_cache).view(2, num_blocks, -1).index_select(1, ids).view(kv_cache.dtype)
    keys, values = both[0].view(shape), both[1].view(shape)
    return from_cache_rows(keys, dtype), from_cache_rows(values, dtype)


def _decode_attention(
    query: torch.Tensor,  # [B, heads, d], one new token per request
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]
    max_len: int,
    scale: float,
) -> torch.Tensor:
    batch, heads, head_dim = query.shape
    kv_heads = kv_cache.shape[3]
    keys, values = _gather_context(kv_cache, block_tables, max_len, query.dtype)  # [B, L, kv, d]
    length = keys.shape[1]
    # GQA without copying K/V: the heads sharing a KV head become that head's query rows.
    q = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    valid = torch.arange(length, device=query.device)[None, :] < seq_lens[:, None].to(torch.int64)
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=valid[:, None, None, :],
        scale=scale,
    )  # fmt: skip
    return out.reshape(batch, heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [q_len, heads, d]: the last q_len positions of the context
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    q_len, heads, head_dim = query.shape
    kv_heads = kv_cache.shape[3]
    keys, values = _gather_context(kv_cache, block_table[None, :], seq_len, query.dtype)
    keys = keys[0, :seq_len].transpose(0, 1)  # [kv_heads, L, d]
    values = values[0, :seq_len].transpose(0, 1)
    group = heads // kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
    q = query.transpose(0, 1)  # [heads, q_len, d]
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
    else:
        offset = seq_len - q_len
        rows = torch.arange(q_len, device=query.device)[:, None] + offset
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_lens_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """Attention of each request's new tokens to its whole context in the paged cache.

    ``query`` is [T, heads, d], flattened request by request (``query_start_loc``); the new
    tokens of request ``i`` are the last ``query_lens_cpu[i]`` of its ``seq_lens_cpu[i]``
    context positions, already written to ``kv_cache``. Returns [T, heads, d].
    """
    out = torch.empty_like(query)
    decode_reqs = [i for i, n in enumerate(query_lens_cpu) if n == 1]
    decodes_first = bool(decode_reqs) and len(decode_reqs) == decode_reqs[-1] + 1
    # Decodes go in chunks whose gathered K/V (~4 MiB) stay in cache for the attention that
    # reads them right after: 1.8x faster per step at 512-token contexts than one gather.
    longest = max((seq_lens_cpu[i] for i in decode_reqs), default=0)
    per_req = 2 * longest * kv_cache.shape[3] * query.shape[2] * query.element_size()
    chunk = max(1, _DECODE_CHUNK_BYTES // max(per_req, 1))
    for first in range(0, len(decode_reqs), chunk):
        part = decode_reqs[first : first + chunk]
        if decodes_first:  # the scheduler's order: decode i is row i
            rows: torch.Tensor | slice = slice(part[0], part[-1] + 1)
            reqs: torch.Tensor | slice = rows
        else:
            reqs = torch.tensor(part, device=query.device)
            rows = query_start_loc[reqs].to(torch.int64)
        max_len = max(seq_lens_cpu[i] for i in part)
        out[rows] = _decode_attention(
            query[rows], kv_cache, block_tables[reqs], seq_lens[reqs], max_len, scale
        )
    start = 0
    for i, (q_len, s_len) in enumerate(zip(query_lens_cpu, seq_lens_cpu, strict=True)):
        if q_len > 1:
            out[start : start + q_len] = _prefill_attention(
                query[start : start + q_len], kv_cache, block_tables[i], s_len, scale
            )
        start += q_len
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm of ``x`` times ``weight``.

    float32 runs HF's exact formula through one fused op (``F.rms_norm``); other dtypes
    normalize in float32 and round before the weight, as HF does.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (when given), then :func:`rms_norm_ref` of ``x``."""
    if delta is not None:
        x.add_(delta)
    return rms_norm_ref(x, weight, eps)


def rope_write_kv_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys of ``qkv`` ([T, (heads + 2 kv_heads) * d]) rotated with RoPE
    (rotate-half layout; ``cos``/``sin`` [T, 1, d / 2] in qkv's dtype), and the values: three
    ``[T, heads or kv_heads, d]`` tensors. Queries and keys rotate together, in one call."""
    tokens = qkv.shape[0]
    qk_width = (num_heads + num_kv_heads) * head_dim
    x1, x2 = qkv[:, :qk_width].view(tokens, -1, head_dim).chunk(2, dim=-1)
    qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    v = qkv[:, qk_width:].view(tokens, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v
