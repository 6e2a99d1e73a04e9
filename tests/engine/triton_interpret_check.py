"""Compare each Triton kernel with its PyTorch reference under ``TRITON_INTERPRET=1``.

Run as a script (``python triton_interpret_check.py``) in a process whose environment sets
``TRITON_INTERPRET=1`` before triton is imported; prints one JSON line per case with the max
absolute difference. ``test_kernels.py`` starts it and asserts on the output.
"""

from __future__ import annotations

import json
import os
import random

import torch

from engine.attention import AttentionMetadata
from engine.kernels.reference import paged_attention_ref, write_kv_cache_ref
from engine.kv_cache_dtype import cache_shape

# (heads, kv_heads, head_dim, block_size, [(query_len, seq_len), ...])
CASES = [
    (4, 2, 16, 4, [(1, 5), (1, 9), (1, 1)]),  # decodes only, GQA 2
    (4, 1, 16, 8, [(7, 7), (3, 12), (1, 20)]),  # prefill, chunk on a context, decode; GQA 4
    (2, 2, 8, 16, [(1, 3), (18, 18), (5, 37)]),  # MHA, chunk spanning blocks
    (6, 3, 24, 2, [(4, 4), (1, 11), (2, 6)]),  # head_dim not a power of two, tiny blocks
]


def _random_tables(rng: random.Random, seq_lens: list[int], block_size: int) -> list[list[int]]:
    needed = [-(-s // block_size) for s in seq_lens]
    pool = list(range(1, sum(needed) + 3))  # block 0 stays unused: padding must not leak
    rng.shuffle(pool)
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at : at + n])
        at += n
    return tables


def run_case(
    case: tuple, dtype: torch.dtype, seed: int, cache_dtype: torch.dtype | None = None
) -> dict[str, float]:
    """One shape: the Triton writer's cache against the reference writer's, and the Triton
    attention's output against the reference's on the same cache (of ``cache_dtype``, default
    ``dtype``; int8: rows with their scales, engine.kv_cache_dtype)."""
    from engine.kernels.triton_kv_cache_write import write_kv_cache_triton
    from engine.kernels.triton_paged_attention import paged_attention_triton

    heads, kv_heads, head_dim, block_size, shape = case
    rng = random.Random(seed)
    torch.manual_seed(seed)
    q_lens = [q for q, _ in shape]
    s_lens = [s for _, s in shape]
    tables = _random_tables(rng, s_lens, block_size)
    num_blocks = max(max(t) for t in tables) + 1
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size)
    cache_dtype = cache_dtype or dtype
    cache_ref = torch.zeros(cache_shape(cache_dtype, num_blocks, block_size, kv_heads, head_dim),
                            dtype=cache_dtype)  # fmt: skip
    old = AttentionMetadata.build([num_blocks * block_size], [num_blocks * block_size],
                                  [list(range(num_blocks))], block_size)  # fmt: skip
    olds = torch.randn(2, num_blocks * block_size, kv_heads, head_dim).to(dtype)
    write_kv_cache_ref(olds[0], olds[1], cache_ref, old.slot_mapping)  # old context: random
    cache_tri = cache_ref.clone()
    tokens = sum(q_lens)
    # K/V as strided views of one fused projection, like the model passes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    write_kv_cache_ref(k, v, cache_ref, meta.slot_mapping)
    write_kv_cache_triton(k, v, cache_tri, meta.slot_mapping)
    scale = head_dim**-0.5
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    lens = (meta.query_lens_cpu, meta.seq_lens_cpu)
    out_ref = paged_attention_ref(q, cache_ref, *args, *lens)
    out_tri = paged_attention_triton(q, cache_ref, *args, *lens)
    return {
        "cache_diff": float((cache_ref.float() - cache_tri.float()).abs().max()),
        "cache_equal": bool(torch.equal(cache_ref, cache_tri)),
        "attn_diff": float((out_ref.float() - out_tri.float()).abs().max()),
    }


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this check")
    for i, case in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            for kv in ("auto", "int8"):
                result = run_case(case, dtype, i, torch.int8 if kv == "int8" else None)
                print(json.dumps({"case": i, "dtype": str(dtype), "kv": kv, **result}), flush=True)


if __name__ == "__main__":
    main()
