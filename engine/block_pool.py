"""Physical KV blocks: reference counts, an LRU free list, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine.kv_events import CLEARED, EVICTED, STORED, KVEventLog


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of ``block_size`` KV slots on the device.

    ``prev``/``next`` link the block into :class:`FreeBlockQueue` while ``ref_cnt`` is 0.
    ``block_hash`` is set once the block is full and registered in the prefix cache; it is
    cleared when the block is evicted (handed out again for new tokens).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted first (least recently freed).

    A doubly linked list threaded through the blocks themselves, with sentinel head and tail.
    Not a deque: a prefix-cache hit must take a block out of the *middle* of the queue, which a
    deque does in O(n); here it is O(1) and no object is allocated per operation.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None  # the sentinels are always linked
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:  # head (next to evict) first; tests, debugging
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """All device KV blocks of one engine.

    Invariants: every block is either referenced (``ref_cnt > 0``, not in the free queue) or
    free (``ref_cnt == 0``, in the free queue exactly once). A block in ``cached`` has
    ``block_hash`` set and maps back to itself. Free blocks that carry a hash are still
    prefix-cache hits until :meth:`get_new_blocks` evicts them. Not thread-safe: the
    engine loop is its only user. With ``events``, every hash entering or leaving ``cached`` is
    recorded there (engine/kv_events.py), in the order it happened.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.events = events

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting their cache entries)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.events is not None:
                        self.events.record(EVICTED, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the queue tail in order.

        Pass a request's blocks tail first, so its last (least shared) block is evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its hash.

        If another block already holds the same content, the map keeps that one and this block
        stays unhashed (it is freed and reused like any other).
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.record(STORED, block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks stay where they are."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.record(CLEARED)
