"""KVCacheManager: prefix-cache hits and accounting, salts, allocation, swap.

Pool sizing lives in engine/model_runner.py (num_kv_blocks), tested in test_model_runner.py.
"""

from __future__ import annotations

import pytest

from engine.config import parse_memory
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` the way the scheduler does, compute its whole prompt; return hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    kv.record_prefix_lookup(req.num_tokens, num_hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return num_hit


def test_shared_400_token_prefix_skips_the_cached_full_blocks() -> None:
    kv = KVCacheManager(100, BS, hash_seed=b"s" * 32)
    prefix = list(range(1000, 1400))
    first = make_request("a", [*prefix, 1, 2, 3])
    assert prefill(kv, first) == 0
    kv.free(first)  # finished: its blocks stay cached in the free queue

    second = make_request("b", [*prefix, 7, 8, 9, 10])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 400 // BS * BS == 400
    assert [b.block_id for b in hits] == first_block_ids(kv, prefix)
    assert kv.allocate_slots(second, second.num_tokens - num_hit, hits) is not None
    assert second.block_ids[:25] == [b.block_id for b in hits]


def first_block_ids(kv: KVCacheManager, prefix: list[int]) -> list[int]:
    probe = make_request("probe", [*prefix, 0])
    hits, _ = kv.get_computed_blocks(probe)
    return [b.block_id for b in hits]


def test_the_last_prompt_token_is_always_computed() -> None:
    kv = KVCacheManager(100, BS)
    prompt = list(range(400))  # exactly 25 full blocks
    prefill(kv, make_request("a", prompt))
    again = make_request("b", list(prompt))
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == (400 - 1) // BS * BS == 384  # the 25th block is recomputed
    partial = make_request("c", prompt[:20])
    assert kv.get_computed_blocks(partial)[1] == 16


def test_hit_accounting_counts_tokens() -> None:
    kv = KVCacheManager(100, BS)
    prefill(kv, make_request("a", list(range(100))))
    prefill(kv, make_request("b", [*range(64), 5, 5, 5]))
    stats = kv.stats()
    assert stats.prefix_cache_queries == 100 + 67
    assert stats.prefix_cache_hits == 64


def test_only_full_computed_blocks_are_cached() -> None:
    kv = KVCacheManager(10, BS)
    req = make_request("a", list(range(40)))
    kv.allocate_slots(req, 40)
    kv.cache_blocks(req, 20)  # one full block computed so far (chunked prefill)
    assert len(kv.pool.cached) == 1
    kv.cache_blocks(req, 40)
    assert len(kv.pool.cached) == 2  # tokens 32..39 fill only half a block
    assert len(req.block_hashes) == 2


def test_cache_salt_isolates_tenants() -> None:
    kv = KVCacheManager(100, BS)
    tokens = list(range(64))
    prefill(kv, make_request("a", [*tokens, 1], salt="tenant-a"))
    assert kv.get_computed_blocks(make_request("b", [*tokens, 1], salt="tenant-b"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", [*tokens, 1], salt=None))[1] == 0
    assert kv.get_computed_blocks(make_request("d", [*tokens, 1], salt="tenant-a"))[1] == 64


def test_hashes_depend_on_the_whole_prefix_and_the_process_seed() -> None:
    kv = KVCacheManager(100, BS)
    prefill(kv, make_request("a", [*range(32), 0]))
    # Same second block, different first block: the chain differs, no hit at all.
    other = make_request("b", [*range(100, 116), *range(16, 32), 0])
    assert kv.get_computed_blocks(other)[1] == 0
    r1, r2 = make_request("x", list(range(17))), make_request("y", list(range(17)))
    KVCacheManager(4, BS).get_computed_blocks(r1)
    KVCacheManager(4, BS).get_computed_blocks(r2)
    assert r1.block_hashes != r2.block_hashes  # a random root per manager


def test_prefix_caching_disabled_means_no_hashing_and_no_hits() -> None:
    kv = KVCacheManager(100, BS, enable_caching=False)
    prefill(kv, make_request("a", list(range(64))))
    again = make_request("b", list(range(64)))
    assert kv.get_computed_blocks(again) == ([], 0)
    assert again.block_hashes == [] and kv.pool.cached == {}
    assert kv.stats().prefix_cache_queries == 0


def test_allocate_returns_none_and_changes_nothing_when_full() -> None:
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(40)))
    assert len(kv.allocate_slots(a, 40)) == 3
    b = make_request("b", list(range(1000, 1040)))
    assert kv.allocate_slots(b, 40) is None
    assert b.block_ids == [] and kv.pool.num_free == 1
    a.num_computed_tokens = 40
    assert kv.allocate_slots(a, 8) == []  # still inside the third block
    assert len(kv.allocate_slots(a, 9)) == 1  # position 48 opens a fourth block
    assert kv.pool.num_free == 0 and len(a.block_ids) == 4


def test_hits_sitting_in_the_free_queue_count_against_free_blocks() -> None:
    kv = KVCacheManager(4, BS)
    first = make_request("a", list(range(33)))
    prefill(kv, first)  # 3 blocks, 2 of them full and cached
    kv.free(first)
    assert kv.pool.num_free == 4
    second = make_request("b", [*range(32), *range(500, 540)])  # 72 tokens: 5 blocks
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 32
    # 2 hits + 3 new blocks = 5 > 4: refused even though 4 blocks are "free".
    assert kv.allocate_slots(second, second.num_tokens - num_hit, hits) is None
    assert all(b.ref_cnt == 0 for b in hits) and kv.pool.num_free == 4
    # A smaller chunk fits: 2 hits + 2 new blocks.
    assert len(kv.allocate_slots(second, 20, hits)) == 2
    assert kv.pool.num_free == 0


def test_free_returns_blocks_tail_first() -> None:
    kv = KVCacheManager(4, BS)
    req = make_request("a", list(range(48)))
    kv.allocate_slots(req, 48)
    table = list(req.block_ids)
    kv.free(req)
    assert [b.block_id for b in kv.pool.free_queue][-3:] == table[::-1]
    assert req.block_ids == []
    kv.free(req)  # idempotent


def test_swap_out_then_in_pairs_are_consistent_and_the_cpu_pool_is_freed() -> None:
    kv = KVCacheManager(6, BS, num_cpu_blocks=4)
    req = make_request("a", list(range(40)))
    kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    gpu_before = list(req.block_ids)

    out_pairs = kv.swap_out(req)
    assert out_pairs is not None and [g for g, _ in out_pairs] == gpu_before
    cpu_blocks = [c for _, c in out_pairs]
    assert len(set(cpu_blocks)) == 3 and kv.stats().num_used_cpu_blocks == 3
    assert kv.pool.num_free == 6 and req.block_ids == []
    assert kv.num_swapped_blocks(req) == 3

    in_pairs = kv.swap_in(req, 1)  # one decode token: still 3 blocks (41 tokens)
    assert in_pairs is not None and [c for c, _ in in_pairs] == cpu_blocks
    assert [g for _, g in in_pairs] == req.block_ids and len(req.block_ids) == 3
    assert kv.stats().num_used_cpu_blocks == 0 and kv.pool.num_free == 3
    kv.free(req)
    assert kv.pool.num_free == 6


def test_swap_out_refuses_when_the_cpu_pool_is_too_small() -> None:
    kv = KVCacheManager(6, BS, num_cpu_blocks=2)
    req = make_request("a", list(range(40)))
    kv.allocate_slots(req, 40)
    assert kv.swap_out(req) is None
    assert len(req.block_ids) == 3 and kv.stats().num_used_cpu_blocks == 0


def test_swap_in_refuses_when_the_gpu_pool_is_full() -> None:
    kv = KVCacheManager(3, BS, num_cpu_blocks=3)
    req = make_request("a", list(range(40)))
    kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    kv.swap_out(req)
    other = make_request("b", list(range(100, 140)))
    kv.allocate_slots(other, 40)
    assert kv.swap_in(req, 1) is None
    assert kv.num_swapped_blocks(req) == 3
    kv.free(req)  # an aborted swapped request gives its CPU blocks back
    assert kv.stats().num_used_cpu_blocks == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4g", 4 * 2**30),
        ("1024", 1024),
        (" 8 KiB ", 8192),
        (123456, 123456),
    ],
)
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["", "2XB", "-1GiB", "0", "GiB", "1.2.3G", True])
def test_parse_memory_rejects_nonsense_naming_the_flag(bad: object) -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_memory(bad)  # type: ignore[arg-type]
