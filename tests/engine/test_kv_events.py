"""Block events of the prefix cache (engine/kv_events.py) and the public hash function a router
uses to match them (kv_cache_manager.prefix_block_hashes)."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import CLEARED, EVICTED, STORED, KVEventLog
from engine.lora.adapter import LoRARequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from portico.contract import prefix_block_hashes, with_shared_prefix

BS = 4


def prefill(kv: KVCacheManager, req: Request) -> None:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)


def request(rid: str, tokens: list[int], salt: str | None = None, **kw: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), cache_salt=salt, **kw)  # type: ignore[arg-type]


def test_stored_blocks_are_events_and_the_snapshot_holds_them() -> None:
    kv = KVCacheManager(16, BS, hash_seed=b"r" * 32)
    assert kv.events is not None
    req = request("a", list(range(10)))  # 2 full blocks, 2 tokens in a third
    prefill(kv, req)
    batch = kv.events.since(1)
    assert not batch.resync and batch.next_seq == 3
    assert [(e.seq, e.kind) for e in batch.events] == [(1, STORED), (2, STORED)]
    assert [e.block_hash for e in batch.events] == req.block_hashes[:2]
    snap = kv.events.snapshot()
    assert set(snap.hashes) == set(req.block_hashes[:2]) and snap.next_seq == 3
    assert kv.events.since(3).events == []  # caught up


def test_a_reused_cached_block_is_an_evicted_event() -> None:
    kv = KVCacheManager(2, BS, hash_seed=b"r" * 32)  # room for exactly one 2-block prompt
    assert kv.events is not None
    first = request("a", list(range(8)))
    prefill(kv, first)
    kv.free(first)
    second = request("b", list(range(100, 108)))  # needs both blocks: evicts both hashes
    prefill(kv, second)
    kinds = [(e.kind, e.block_hash) for e in kv.events.since(1).events]
    evicted = [h for k, h in kinds if k == EVICTED]
    assert sorted(evicted) == sorted(first.block_hashes[:2])
    assert set(kv.events.snapshot().hashes) == set(second.block_hashes[:2])


def test_reset_prefix_cache_is_one_cleared_event() -> None:
    kv = KVCacheManager(8, BS)
    assert kv.events is not None
    prefill(kv, request("a", list(range(9))))
    kv.pool.reset_prefix_cache()
    last = kv.events.since(1).events[-1]
    assert last.kind == CLEARED and kv.events.snapshot().hashes == []


def test_a_reader_behind_the_ring_or_from_another_epoch_must_resync() -> None:
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.record(STORED, bytes([i]) * 32)
    assert log.since(1).resync  # events 1 and 2 fell off the ring
    assert [e.seq for e in log.since(3).events] == [3, 4, 5]
    assert log.since(99).resync  # a sequence number this process never issued: a restart
    assert len(log.since(3, limit=2).events) == 2 and log.since(3, limit=2).next_seq == 5
    assert KVEventLog().epoch != log.epoch
    with pytest.raises(ValueError):
        KVEventLog(capacity=0)


def test_no_events_without_prefix_caching() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    assert kv.events is None and kv.pool.events is None


@pytest.mark.parametrize(
    "salt, lora",
    [
        (None, None),
        ("tenant-a", None),
        (with_shared_prefix("tenant-a", "shared-prefix:team", 8), None),
        ("tenant-a", LoRARequest("ad", 7, "/nowhere")),
    ],
)
def test_prefix_block_hashes_are_the_managers_hashes(salt: str | None, lora: object) -> None:
    kv = KVCacheManager(32, BS, hash_seed=b"q" * 32)
    tokens = list(range(50, 69))  # 4 full blocks and 3 tokens
    req = request("a", tokens, salt, lora_request=lora)
    prefill(kv, req)
    lora_id = lora.lora_int_id if isinstance(lora, LoRARequest) else None
    mine = prefix_block_hashes(kv.root_hash, tokens, BS, salt, lora_id)
    assert len(mine) == 4 and mine == req.block_hashes[:4]
    assert prefix_block_hashes(b"x" * 32, tokens, BS, salt, lora_id) != mine  # root matters
    assert prefix_block_hashes(kv.root_hash, tokens, BS, "other", lora_id) != mine
