"""The paged-attention and KV-cache-write kernels.

The PyTorch references are checked against a plain per-token oracle; each Triton kernel is
checked against its reference under ``TRITON_INTERPRET=1`` in a separate process (the variable
must be set before triton is first imported), at tiny shapes: GQA, several block sizes, ragged
lengths, prefill chunks and decodes mixed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.attention import AttentionMetadata
from engine.kernels.reference import paged_attention_ref, write_kv_cache_ref

CHECK_SCRIPT = Path(__file__).with_name("triton_interpret_check.py")


def _oracle_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], q_lens: list[int]
) -> torch.Tensor:
    """Token by token, head by head, in float64: the slow obvious definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, head_dim = q.shape[1], q.shape[2]
    row = 0
    for k, v, q_len in zip(keys, values, q_lens, strict=True):
        seq_len, kv_heads = k.shape[0], k.shape[1]
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(heads):
                kh = h // (heads // kv_heads)
                scores = (k[: pos + 1, kh].double() @ q[row + i, h].double()) / head_dim**0.5
                out[row + i, h] = torch.softmax(scores, 0) @ v[: pos + 1, kh].double()
        row += q_len
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "shape"),
    [
        (4, 2, 4, [(1, 6), (1, 13), (1, 1), (1, 4)]),  # all decodes: the batched path
        (6, 2, 8, [(1, 9), (5, 5), (3, 17), (1, 2)]),  # decodes first, then prefill chunks
        (4, 4, 16, [(20, 20), (1, 30), (2, 7)]),  # a decode between prefills
        (3, 1, 2, [(7, 11)]),
    ],
)
def test_reference_attention_matches_per_token_oracle(
    heads: int, kv_heads: int, block_size: int, shape: list[tuple[int, int]]
) -> None:
    rng = random.Random(heads * 100 + block_size)
    torch.manual_seed(block_size)
    head_dim = 8
    q_lens = [q for q, _ in shape]
    s_lens = [s for _, s in shape]
    needed = [-(-s // block_size) for s in s_lens]
    pool = list(range(1, sum(needed) + 4))
    rng.shuffle(pool)  # block tables that are not contiguous; block 0 is padding only
    tables, at = [], 0
    for n in needed:
        tables.append(pool[at : at + n])
        at += n
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size)
    cache = torch.randn(2, max(pool) + 1, block_size, kv_heads, head_dim)
    keys = [torch.randn(s, kv_heads, head_dim) for s in s_lens]
    values = [torch.randn(s, kv_heads, head_dim) for s in s_lens]
    # The old context goes in first; the new tokens arrive through write_kv_cache_ref.
    for k, v, table, q_len in zip(keys, values, tables, q_lens, strict=True):
        for pos in range(k.shape[0] - q_len):
            slot = table[pos // block_size] * block_size + pos % block_size
            cache[0].flatten(0, 1)[slot] = k[pos]
            cache[1].flatten(0, 1)[slot] = v[pos]
    new_k = torch.cat([k[k.shape[0] - n :] for k, n in zip(keys, q_lens, strict=True)])
    new_v = torch.cat([v[v.shape[0] - n :] for v, n in zip(values, q_lens, strict=True)])
    write_kv_cache_ref(new_k, new_v, cache, meta.slot_mapping)
    q = torch.randn(sum(q_lens), heads, head_dim)
    out = paged_attention_ref(
        q,
        cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        head_dim**-0.5,
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
    )
    expected = _oracle_attention(q, keys, values, q_lens)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decodes_in_small_chunks_equal_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunking the batched decode (to keep gathered K/V in cache) changes nothing."""
    from engine.kernels import reference

    torch.manual_seed(0)
    q_lens, s_lens = [1, 1, 1, 1, 1, 4], [9, 3, 17, 1, 12, 6]
    tables = [[5, 2, 7], [1], [3, 8, 9, 4, 10], [6], [11, 12, 13], [14, 15]]
    meta = AttentionMetadata.build(q_lens, s_lens, tables, 4)
    cache = torch.randn(2, 16, 4, 2, 8)
    q = torch.randn(sum(q_lens), 4, 8)
    args = (q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.35,
            q_lens, s_lens)  # fmt: skip
    whole = paged_attention_ref(*args)
    monkeypatch.setattr(reference, "_DECODE_CHUNK_BYTES", 1)  # one request per chunk
    torch.testing.assert_close(paged_attention_ref(*args), whole, atol=1e-6, rtol=1e-6)
    # A prefill first: the decodes are not rows 0..n-1 any more (the index path).
    meta2 = AttentionMetadata.build(
        [q_lens[5]] + q_lens[:5], [s_lens[5]] + s_lens[:5], [tables[5]] + tables[:5], 4
    )
    q2 = torch.cat([q[5:], q[:5]])
    out2 = paged_attention_ref(
        q2, cache, meta2.block_tables, meta2.query_start_loc, meta2.seq_lens, 0.35,
        meta2.query_lens_cpu, meta2.seq_lens_cpu,
    )  # fmt: skip
    torch.testing.assert_close(torch.cat([out2[4:], out2[:4]]), whole, atol=1e-6, rtol=1e-6)


def test_dispatcher_on_cpu_matches_the_reference() -> None:
    """On CPU the dispatcher runs the native kernel when it is built, else the reference."""
    meta = AttentionMetadata.build([2, 1], [2, 3], [[1], [2]], 4)
    cache_a = torch.zeros(2, 3, 4, 1, 8)
    cache_b = torch.zeros(2, 3, 4, 1, 8)
    k, v, q = torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 2, 8)
    kernels.write_kv_cache(k, v, cache_a, meta.slot_mapping)
    write_kv_cache_ref(k, v, cache_b, meta.slot_mapping)
    assert torch.equal(cache_a, cache_b)
    assert torch.equal(cache_a[0, 1, :2, 0], k[:2, 0])  # slots 4, 5: block 1, offsets 0, 1
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.3, [2, 1], [2, 3])
    torch.testing.assert_close(
        kernels.paged_attention(q, cache_a, *args), paged_attention_ref(q, cache_a, *args),
        atol=1e-6, rtol=1e-5,
    )  # fmt: skip


def test_metadata_of_small_and_large_steps_follow_one_layout(monkeypatch) -> None:
    """Decode-sized steps build their slots in plain Python, bigger ones with tensor ops: the
    same tables, starts, lengths and slots either way."""
    from engine import attention

    args = ([1, 3, 2], [5, 7, 2], [[4, 2], [9, 1], [6]], 4)
    small = AttentionMetadata.build(*args)
    monkeypatch.setattr(attention, "_SMALL_STEP", 0)
    large = AttentionMetadata.build(*args)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(small, name), getattr(large, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert small.slot_mapping.tolist() == [8 + 0, 4 + 0, 4 + 1, 4 + 2, 6 * 4 + 0, 6 * 4 + 1]


def test_metadata_rejects_a_table_too_short_for_its_context() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[3, 4]], 4)
    with pytest.raises(ValueError, match="query length"):
        AttentionMetadata.build([5], [4], [[3]], 4)


def test_triton_kernels_match_references_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 16  # 4 shapes x (float32, bfloat16) x (the model's dtype, int8 cache)
    for r in results:
        assert r["cache_diff"] == 0.0 and r["cache_equal"], r  # int8: the same bytes, scales too
        # bf16 outputs carry 8 bits of mantissa: one rounding step at |x| ~ 2 is 1/64.
        limit = 1e-5 if r["dtype"] == "torch.float32" else 2e-2
        assert r["attn_diff"] <= limit, r
