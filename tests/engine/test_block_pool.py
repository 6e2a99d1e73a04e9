"""BlockPool: LRU free queue, reference counts, prefix-cache map, and their invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_pops_in_order_and_removes_from_the_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_blocks_are_handed_out_in_lru_order_and_eviction_drops_the_hash() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([b])  # b was freed first: least recently used
    pool.free_blocks([a])
    assert ids(pool.free_queue) == [b.block_id, a.block_id]
    assert pool.get_cached_block(h(2)) is b  # free but still a cache hit
    (first,) = pool.get_new_blocks(1)
    assert first is b and b.block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is a  # a survives until it is evicted
    assert c.ref_cnt == d.ref_cnt == 1


def test_cache_hit_on_a_free_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(7))
    pool.free_blocks([a])
    assert pool.num_free == 3
    pool.touch([pool.get_cached_block(h(7))])
    assert a.ref_cnt == 1 and pool.num_free == 2 and a not in list(pool.free_queue)
    pool.touch([a])  # a second sharer
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free == 2
    pool.free_blocks([a])
    assert pool.num_free == 3 and pool.get_cached_block(h(7)) is a


def test_duplicate_content_keeps_the_first_block_and_leaves_the_second_unhashed() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(1))
    assert pool.get_cached_block(h(1)) is a and b.block_hash is None


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_caching_disabled_never_registers() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    assert a.block_hash is None and pool.get_cached_block(h(1)) is None


def test_reset_prefix_cache_forgets_hashes() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    pool.reset_prefix_cache()
    assert a.block_hash is None and pool.cached == {}


NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free / touch / cache sequences against a simple reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.held: list[KVBlock] = []  # one entry per reference we hold
        self.next_hash = 0

    @rule(n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n: int) -> None:
        if n > self.pool.num_free:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        blocks = self.pool.get_new_blocks(n)
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
        self.held.extend(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.pool.free_blocks([self.held.pop(i)])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.held))
        self.next_hash += 1
        self.pool.cache_block(block, h(self.next_hash))

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pool.cached)))
        block = self.pool.get_cached_block(key)
        assert block is not None
        self.pool.touch([block])
        self.held.append(block)

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        free = list(pool.free_queue)
        assert len(free) == len({id(b) for b in free}) == pool.num_free  # each at most once
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == sum(1 for b in self.held if b is block)
            assert (block.ref_cnt == 0) == (block in free)  # in use xor free
        assert pool.num_free + pool.num_used == NUM_BLOCKS
        assert pool.num_used == len({id(b) for b in self.held})
        for key, block in pool.cached.items():
            assert block.block_hash == key
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached)


TestBlockPoolProperties = BlockPoolMachine.TestCase
TestBlockPoolProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
