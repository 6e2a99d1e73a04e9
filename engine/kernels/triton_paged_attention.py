"""Triton kernel: causal attention of each request's new tokens to its paged context.

Twin of :func:`engine.kernels.reference.paged_attention_ref` (same signature, same result).
It serves prefill chunks and decodes alike. One program handles ``BLOCK_M`` query tokens of
one request and one query head; it walks the request's context ``BLOCK_N`` positions at a time,
finds each position's slot through the block table (so the cache's block size is independent
of the tile size), and keeps an online softmax in float32. GQA: query head ``h`` reads KV head
``h // (heads // kv_heads)``. An int8 cache (:mod:`engine.kv_cache_dtype`) is read through
the same loop: each K/V row widened to float32 and multiplied by its scale, read from the 4
bytes after the row's values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_kv(
    cache_ptr, scale_ptr, slots, kv_head, offs_d, n_mask, d_mask, v_offset,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr,
):  # fmt: skip
    """K and V of the cache slots ``slots`` for ``kv_head``, as float32 ``[BLOCK_N, BLOCK_D]``
    (an int8 cache's rows times their scales); masked positions and dims read 0."""
    row = HEAD_DIM + 4 if KV_INT8 else HEAD_DIM
    rows = (slots * NUM_KV_HEADS + kv_head) * row
    kv_off = rows[:, None] + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    if KV_INT8:
        k_scale = tl.load(scale_ptr + (rows + HEAD_DIM) // 4, mask=n_mask, other=0.0)
        v_scale = tl.load(scale_ptr + (v_offset + rows + HEAD_DIM) // 4, mask=n_mask, other=0.0)
        k = k * k_scale[:, None]
        v = v * v_scale[:, None]
    return k, v


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,  # int8 cache: the cache's memory as float32, for each row's scale; else unused
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    v_offset,  # elements from the K half of the cache to its V half (bytes for int8)
    bt_stride,  # elements between rows of block_tables
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for a float32 cache; "tf32" holds bf16/fp16 K/V exactly
    KV_INT8: tl.constexpr,  # the cache holds int8 rows of HEAD_DIM values + a float32 scale
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        kv_head = head // GROUP
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        q_pos = seq_len - q_len + offs_m  # absolute positions of these queries
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys past the last query of this tile are masked for every row: stop there.
        end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            block = tl.load(
                block_tables_ptr + req * bt_stride + offs_n // BLOCK_SIZE, mask=n_mask, other=0
            ).to(tl.int64)
            slots = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
            k, v = _load_kv(
                cache_ptr, scale_ptr, slots, kv_head, offs_d, n_mask, d_mask, v_offset,
                NUM_KV_HEADS, HEAD_DIM, KV_INT8,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # A row with no allowed key yet keeps m = -inf; guard exp(-inf - -inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_lens_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """Attention of each request's new tokens ([T, heads, d]) to its paged context."""
    tokens, heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    block_m = 16
    max_query_len = max(query_lens_cpu)
    grid = (len(query_lens_cpu), heads, triton.cdiv(max_query_len, block_m))
    kv_int8 = kv_cache.dtype == torch.int8
    _paged_attention_kernel[grid](
        query,
        kv_cache,
        kv_cache.view(torch.float32) if kv_int8 else kv_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        block_tables.stride(0),
        NUM_KV_HEADS=kv_heads,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=16,
        # int8 K/V widened and scaled are not bf16-exact: keep them in full float32 products
        PRECISION="ieee" if query.dtype == torch.float32 or kv_int8 else "tf32",
        KV_INT8=kv_int8,
    )
    return out
