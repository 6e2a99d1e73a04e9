"""Triton kernel: paged attention for pure-decode steps (one new token per request), split-K.

Twin of :func:`engine.kernels.reference.paged_attention_ref` on steps where every query length
is 1. Decode attention is a read of the KV cache and little else, so the kernel is built to
read each byte of it once and to keep the whole card busy:

* **One program per (request, KV head, split)**, holding every query head of that KV head's
  GQA group as the rows of one ``[BLOCK_H, d]`` tile (padded to 16 rows, ``tl.dot``'s
  minimum). Each ``[BLOCK_N, d]`` K/V tile is loaded once and serves the whole group; the
  general kernel (:mod:`engine.kernels.triton_paged_attention`) loads it once per query head.
* **Split-K (flash-decoding).** A request's context is cut into ``num_splits`` pieces of
  ``cdiv(seq_len, num_splits)`` tokens (rounded up to ``BLOCK_N``), each piece a program,
  so one long sequence still fills the card. Each program writes its piece's output,
  normalized, and the log-sum-exp of its scores; a second kernel merges the pieces:
  ``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)`` with ``M = max_s lse_s``. An
  empty piece (a short sequence) writes ``lse = -inf`` and weighs nothing. With one split the
  first kernel writes the output itself and the merge is skipped.
* The split count depends only on the batch shape (:func:`num_kv_splits`), never on a
  step's lengths, so a CUDA graph captured for a batch size serves every step of that size.
* **Every cache dtype** (:mod:`engine.kv_cache_dtype`): bf16/fp16/fp32 rows as stored; int8
  rows widened exactly to the query's dtype, their float32 per-row scale (the 4 bytes after
  the row) applied to the scores (K) and to the probabilities (V) rather than to every element;
  fp8_e4m3 rows (scale 1) widened exactly to the query's dtype. Products run on the tensor
  cores in the query's dtype (exact for bf16/fp16 inputs) with float32 sums; a float32 query
  keeps full float32 products (``"ieee"``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Splits are added until the grid has about this many programs per streaming multiprocessor.
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 16
_BLOCK_N = 32  # context positions per K/V tile


@triton.jit
def _dot(a, b, WIDE: tl.constexpr):
    """``a @ b`` with float32 sums. ``WIDE``: the operands (already rounded to their dtype)
    widened to float32 and multiplied exactly, the same products as a 16-bit tensor-core dot;
    Triton's interpreter needs it (its bf16 ``tl.dot`` returns garbage) and a float32 query
    wants it."""
    if WIDE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr,
    scale_ptr,  # int8 cache: the cache's memory as float32, for each row's scale; else unused
    out_ptr,  # one split: the output [T, heads, d]; several: the pieces [T, heads, S, d] fp32
    lse_ptr,  # several splits: [T, heads, S] float32; else unused
    block_tables_ptr, seq_lens_ptr, scale, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    v_offset,  # elements from the K half of the cache to its V half (bytes for int8)
    bt_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_INT8: tl.constexpr,
    EXACT_F32: tl.constexpr,  # float32 query: float32 products
    WIDE_DOT: tl.constexpr,  # Triton's interpreter: 16-bit operands widened before tl.dot
):  # fmt: skip
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    qd_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + req.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=qd_mask,
        other=0.0,
    )
    if EXACT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    row = HEAD_DIM + 4 if KV_INT8 else HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        block = tl.load(
            block_tables_ptr + req * bt_stride + offs_n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        rows = ((block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * row
        kv_off = rows[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # Widen to the query's dtype: exact for int8 (|x| <= 127) and fp8 values in bf16/fp16.
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0)
        if WIDE_DOT:  # the interpreter converts int8 to bf16 wrongly; through float32 it is exact
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        k = k.to(q.dtype)
        scores = _dot(q, tl.trans(k), EXACT_F32 or WIDE_DOT)
        if KV_INT8:
            k_scale = tl.load(scale_ptr + (rows + HEAD_DIM) // 4, mask=n_mask, other=0.0)
            scores = scores * k_scale[None, :]
        scores = tl.where(n_mask[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_INT8:
            v_scale = tl.load(scale_ptr + (v_offset + rows + HEAD_DIM) // 4, mask=n_mask, other=0.0)
            p = p * v_scale[None, :]
        pv = _dot(p.to(q.dtype), v.to(q.dtype), EXACT_F32 or WIDE_DOT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    _store_piece(
        acc, m_i, l_i, out_ptr, lse_ptr, req, heads, split, offs_d, qd_mask, h_mask,
        o_stride_t, o_stride_h, NUM_KV_HEADS * GROUP, HEAD_DIM, NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _store_piece(
    acc, m_i, l_i, out_ptr, lse_ptr, req, heads, split, offs_d, qd_mask, h_mask,
    o_stride_t, o_stride_h, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Write a piece's normalized output (the output itself with one split) and its
    log-sum-exp. A piece with no position (a sequence shorter than the splits) has l = 0:
    output 0, lse = -inf, so the merge gives it no weight."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = req.to(tl.int64) * o_stride_t + heads * o_stride_h
    if NUM_SPLITS == 1:
        out_offsets = o_rows[:, None] + offs_d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        piece = (o_rows * NUM_SPLITS + split * HEAD_DIM)[:, None] + offs_d[None, :]
        tl.store(out_ptr + piece, out, mask=qd_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.maximum(l_i, 1e-30)))
        lse_rows = (req.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(lse_ptr + lse_rows, lse, mask=h_mask)


@triton.jit
def _merge_splits_kernel(
    pieces_ptr,  # [T, heads, S, d] float32, contiguous
    lse_ptr,  # [T, heads, S] float32
    out_ptr,
    o_stride_t,
    o_stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    base = req.to(tl.int64) * NUM_HEADS + head
    lse = tl.load(lse_ptr + base * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: every sequence has a position, so one piece is not empty
    weights = tl.exp(lse - top)
    pieces = tl.load(
        pieces_ptr + (base * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(pieces * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(
        out_ptr + req.to(tl.int64) * o_stride_t + head * o_stride_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """How many pieces each context is cut into: enough that ``num_seqs * num_kv_heads *
    splits`` programs give every SM about two, at most 16. A function of the batch shape
    only, so a captured graph keeps it."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-_PROGRAMS_PER_SM * num_sms // programs)
    return max(1, min(_MAX_SPLITS, wanted))


def serves(kv_cache: torch.Tensor) -> bool:
    """Whether this kernel reads ``kv_cache``: every dtype, but an fp8 cache only where
    Triton converts float8_e4m3 (compute capability 8.9 and later; the interpreter)."""
    if not _fp8(kv_cache) or kv_cache.device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(kv_cache.device) >= (8, 9)


def _fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype.itemsize == 1 and kv_cache.dtype != torch.int8


@functools.cache
def _num_sms_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms_of(device.index if device.index is not None else 0)
    return 1


def decode_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each request's one new token (``query`` [B, heads, d], row ``i`` for
    request ``i``) to its ``seq_lens[i]`` positions in the paged cache; returns [B, heads, d].

    ``num_splits`` fixes the split count (tests); by default :func:`num_kv_splits` of the
    batch shape and the device.
    """
    batch, heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    group = heads // kv_heads
    splits = num_splits or num_kv_splits(batch, kv_heads, _num_sms(query.device))
    block_d = max(16, triton.next_power_of_2(head_dim))
    kv_int8 = kv_cache.dtype == torch.int8
    if splits > 1:
        pieces = torch.empty(batch, heads, splits, head_dim, device=query.device)
        lse = torch.empty(batch, heads, splits, device=query.device)
        target, t_stride, h_stride = pieces, heads * head_dim, head_dim
    else:
        pieces = lse = out
        target, t_stride, h_stride = out, out.stride(0), out.stride(1)
    _decode_split_kernel[(batch, kv_heads, splits)](
        query,
        kv_cache,
        kv_cache.view(torch.float32) if kv_int8 else kv_cache,
        target,
        lse,
        block_tables,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        t_stride,
        h_stride,
        kv_cache.stride(0),
        block_tables.stride(0),
        NUM_KV_HEADS=kv_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N,
        NUM_SPLITS=splits,
        KV_INT8=kv_int8,
        EXACT_F32=query.dtype == torch.float32,
        WIDE_DOT=os.environ.get("TRITON_INTERPRET") == "1",
    )
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
            pieces,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )
    return out
