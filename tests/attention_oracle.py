"""Causal attention token by token in float64, the reference the attention kernels are held to,
and the paged cases they are held to it on (``from attention_oracle import attention_oracle,
paged_case``; tests/ is on sys.path because tests/conftest.py lives there)."""

from __future__ import annotations

import random

import torch

from engine.attention import AttentionMetadata
from engine.kernels.reference import from_cache_rows, to_cache_rows, write_kv_cache_ref
from engine.kv_cache_dtype import cache_shape


def attention_oracle(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], q_lens: list[int], scale: float
) -> torch.Tensor:
    """Each request's ``q_lens[i]`` last query rows of ``q`` [T, heads, d] against its whole
    context ``ks[i]``, ``vs[i]`` [seq, kv_heads, d], each row seeing its own position and the
    ones before it; GQA by head groups."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads = q.shape[1]
    row = 0
    for k, v, q_len in zip(ks, vs, q_lens, strict=True):
        group = heads // k.shape[1]
        for i in range(q_len):
            pos = k.shape[0] - q_len + i
            for h in range(heads):
                scores = (k[: pos + 1, h // group].double() @ q[row + i, h].double()) * scale
                out[row + i, h] = torch.softmax(scores, 0) @ v[: pos + 1, h // group].double()
        row += q_len
    return out


def paged_case(heads: int, kv_heads: int, head_dim: int, block_size: int,
               shape: list[tuple[int, int]], dtype: torch.dtype, seed: int,
               cache_dtype: torch.dtype | None = None):  # fmt: skip
    """A paged KV cache holding random K/V for requests of (query rows, context) ``shape``, on
    shuffled blocks: the queries (a strided view, as the model passes them), the cache, the
    step's metadata, each request's K and V, and the query rows per request. The cache is in
    ``cache_dtype`` (default ``dtype``); K and V are returned as it holds them (an int8 or fp8
    cache's rounding included), so the oracle on them measures the kernel, not the rounding."""
    cache_dtype = cache_dtype or dtype
    rng = random.Random(seed)
    torch.manual_seed(seed)
    q_lens, s_lens = [q for q, _ in shape], [s for _, s in shape]
    needed = [-(-s // block_size) for s in s_lens]
    pool = list(range(1, sum(needed) + 3))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at : at + n])
        at += n
    shape5 = cache_shape(cache_dtype, len(pool) + 1, block_size, kv_heads, head_dim)
    cache = torch.zeros(shape5, dtype=cache_dtype)
    ks = [torch.randn(s, kv_heads, head_dim).to(dtype) for s in s_lens]
    vs = [torch.randn(s, kv_heads, head_dim).to(dtype) for s in s_lens]
    whole = AttentionMetadata.build(s_lens, s_lens, tables, block_size)
    write_kv_cache_ref(torch.cat(ks), torch.cat(vs), cache, whole.slot_mapping)
    if cache_dtype != dtype:
        ks = [from_cache_rows(to_cache_rows(k, cache_dtype), torch.float32) for k in ks]
        vs = [from_cache_rows(to_cache_rows(v, cache_dtype), torch.float32) for v in vs]
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size)
    # Queries as a strided view of a wider qkv-like row, as the model passes them.
    wide = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim).to(dtype)
    return wide[:, :heads], cache, meta, ks, vs, q_lens


def float16_edge_rows(rows: int, width: int) -> torch.Tensor:
    """float32 values whose float16 rounding has edges: ties to even, the largest finite and
    the overflow to inf, subnormals, their ties, zeros and signs, then random values."""
    edges = [
        1.0 + 2**-11, 1.0 + 3 * 2**-11, -(1.0 + 2**-11),  # ties: down to even, up to even
        65504.0, 65519.99, 65520.0, -65520.0, 1e6,  # the largest finite; beyond: inf
        2**-24, 2**-25, 3 * 2**-25, 2**-26, 2**-14 - 2**-25, 2**-14,  # subnormals, their ties
        0.0, -0.0, 5.960464477539063e-08, -1.5e-5,
    ]  # fmt: skip
    flat = torch.randn(rows * width) * 3
    flat[: len(edges)] = torch.tensor(edges, dtype=torch.float32)
    return flat.view(rows, width)
