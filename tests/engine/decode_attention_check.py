"""Compare the split-K decode attention kernel with the PyTorch reference under
``TRITON_INTERPRET=1``.

Run as a script in a process whose environment sets ``TRITON_INTERPRET=1`` before triton is
imported; prints one JSON line per case with the max absolute difference.
``test_triton_decode_attention.py`` starts it and asserts on the output.
"""

from __future__ import annotations

import json
import os
import random

import torch

from engine.attention import AttentionMetadata
from engine.kernels.reference import paged_attention_ref, write_kv_cache_ref
from engine.kv_cache_dtype import cache_shape, storage_dtype

# (heads, kv_heads, head_dim, block_size, seq_lens): mixed lengths, lengths that are not a
# multiple of the block size, a length-1 context, contexts longer than one K/V tile (32).
CASES = [
    (2, 2, 16, 4, [5, 1, 70, 33]),  # group 1
    (6, 2, 24, 8, [9, 100, 17]),  # group 3, head_dim not a power of two
    (8, 2, 32, 16, [130, 3, 64]),  # group 4
]
SPLITS = (1, 3)
KV = ("auto", "int8", "fp8_e4m3")


def _random_tables(rng: random.Random, seq_lens: list[int], block_size: int) -> list[list[int]]:
    needed = [-(-s // block_size) for s in seq_lens]
    pool = list(range(1, sum(needed) + 3))  # block 0 stays unused: padding must not leak
    rng.shuffle(pool)
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at : at + n])
        at += n
    return tables


def _case_cache(
    case: tuple, cache_dtype: torch.dtype, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    heads, kv_heads, head_dim, block_size, s_lens = case
    tables = _random_tables(random.Random(seed), s_lens, block_size)
    num_blocks = max(max(t) for t in tables) + 1
    cache = torch.zeros(
        cache_shape(cache_dtype, num_blocks, block_size, kv_heads, head_dim), dtype=cache_dtype
    )
    every = AttentionMetadata.build([num_blocks * block_size], [num_blocks * block_size],
                                    [list(range(num_blocks))], block_size)  # fmt: skip
    kv = (torch.randn(2, num_blocks * block_size, kv_heads, head_dim) * 2).to(dtype)
    write_kv_cache_ref(kv[0], kv[1], cache, every.slot_mapping)
    meta = AttentionMetadata.build([1] * len(s_lens), s_lens, tables, block_size)
    return cache, meta


def run_case(case: tuple, dtype: torch.dtype, kv: str, splits: int, seed: int) -> dict:
    """The kernel's output against the reference's on one cache."""
    from engine.kernels.triton_decode_attention import decode_attention_triton

    torch.manual_seed(seed)
    heads, _, head_dim, _, s_lens = case
    cache, meta = _case_cache(case, storage_dtype(kv, dtype), dtype, seed)
    # The query as a strided view of a fused projection, as the model passes it.
    qkv = torch.randn(len(s_lens), (heads + 4) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(len(s_lens), heads, head_dim)
    scale = head_dim**-0.5
    ref = paged_attention_ref(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        meta.query_lens_cpu, meta.seq_lens_cpu,
    )  # fmt: skip
    out = decode_attention_triton(q, cache, meta.block_tables, meta.seq_lens, scale, splits)
    return {
        "attn_diff": float((ref.float() - out.float()).abs().max()),
        "ref_max": float(ref.float().abs().max()),
    }


def front_door_case() -> dict:
    """engine.kernels.paged_attention under the CUDA kernel choice: a pure-decode step goes to
    the split-K kernel, a mixed step to the general Triton kernel; both equal the reference."""
    import engine.kernels as kernels
    from engine.kernels import triton_decode_attention

    cuda = kernels.choose("cuda")
    kernels._choice = lambda t: cuda  # type: ignore[assignment]  # the CUDA pick, on CPU
    called: list[int] = []
    real = triton_decode_attention.decode_attention_triton

    def counting(*args: object, **kw: object) -> torch.Tensor:
        called.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    triton_decode_attention.decode_attention_triton = counting  # type: ignore[assignment]
    case = CASES[1]
    heads, _, head_dim, _, s_lens = case
    cache, meta = _case_cache(case, torch.float32, torch.float32, 7)
    q = torch.randn(len(s_lens), heads, head_dim)
    args = (cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, head_dim**-0.5)
    lens = (meta.query_lens_cpu, meta.seq_lens_cpu)
    decode_diff = kernels.paged_attention(q, *args, *lens) - paged_attention_ref(q, *args, *lens)
    decode_calls = len(called)
    mixed = AttentionMetadata.build([1, 4], [9, 17], meta_tables(meta, [0, 2]), case[3])
    qm = torch.randn(5, heads, head_dim)
    margs = (cache, mixed.block_tables, mixed.query_start_loc, mixed.seq_lens, head_dim**-0.5)
    mlens = (mixed.query_lens_cpu, mixed.seq_lens_cpu)
    mixed_diff = kernels.paged_attention(qm, *margs, *mlens) - paged_attention_ref(
        qm, *margs, *mlens
    )
    return {
        "decode_diff": float(decode_diff.abs().max()),
        "decode_calls": decode_calls,
        "mixed_diff": float(mixed_diff.abs().max()),
        "calls_after_mixed": len(called),
    }


def meta_tables(meta: AttentionMetadata, rows: list[int]) -> list[list[int]]:
    """The block tables of ``rows`` of ``meta`` (their padding included)."""
    return [meta.block_tables[r].tolist() for r in rows]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this check")
    for i, case in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            for kv in KV:
                for splits in SPLITS:
                    result = run_case(case, dtype, kv, splits, i)
                    line = {"case": i, "dtype": str(dtype), "kv": kv, "splits": splits, **result}
                    print(json.dumps(line), flush=True)
    print(json.dumps({"front_door": front_door_case()}), flush=True)
    from engine.kernels.triton_decode_attention import num_kv_splits

    # (seqs, kv heads, SMs) -> splits: an H200 has 132 SMs.
    shapes = [(1, 3, 132), (1, 8, 132), (64, 8, 132), (256, 8, 132), (4, 2, 1)]
    print(json.dumps({"splits": [[*s, num_kv_splits(*s)] for s in shapes]}), flush=True)


if __name__ == "__main__":
    main()
