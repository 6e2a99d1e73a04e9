"""The prefix cache's block events, for a router outside the engine (the gateway's prefix index).

Every full block registered in the prefix cache is a ``stored`` event and every cached block
handed out again for new tokens an ``evicted`` event; forgetting the whole cache
(:meth:`~engine.block_pool.BlockPool.reset_prefix_cache`) is one ``cleared`` event. Hashes are
the engine's own chained block hashes, so a tenant's salt is inside each hash: a reader learns
which hashes are cached, never whose they are.

Readers poll: :meth:`KVEventLog.since` returns the events from a sequence number on, from a
bounded ring (oldest dropped first). A reader that fell behind the ring, or that holds a
sequence number of another engine process (``epoch`` changed: a restart), must resync from
:meth:`KVEventLog.snapshot`, every hash cached now and the sequence number it is exact at.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass
from itertools import islice

STORED = "stored"
EVICTED = "evicted"
CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change to the set of cached blocks; ``seq`` counts from 1 within an epoch."""

    seq: int
    kind: str  # STORED | EVICTED | CLEARED
    block_hash: bytes  # b"" for CLEARED


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The answer to a poll: events ``[since, next_seq)``, or ``resync`` when they are gone."""

    epoch: str
    next_seq: int
    events: list[KVEvent]
    resync: bool  # the reader missed events (ring overflow, or another epoch): take a snapshot


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every hash cached after event ``next_seq - 1``: a reader continues polling at next_seq."""

    epoch: str
    next_seq: int
    hashes: list[bytes]


class KVEventLog:
    """A bounded ring of block events plus the set of hashes cached now.

    Written by the engine loop thread (one call per stored or evicted block), read by the
    server's event loop: one lock guards both, held for a few list operations only. Memory is
    bounded by ``capacity`` events and by the number of blocks in the pool (the cached set).
    """

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.epoch = uuid.uuid4().hex  # new per engine process: readers detect a restart
        self.capacity = capacity
        self._ring: deque[KVEvent] = deque(maxlen=capacity)
        self._cached: set[bytes] = set()
        self._next_seq = 1
        self._lock = threading.Lock()

    def record(self, kind: str, block_hash: bytes = b"") -> None:
        with self._lock:
            if kind == STORED:
                self._cached.add(block_hash)
            elif kind == EVICTED:
                self._cached.discard(block_hash)
            else:
                self._cached.clear()
            self._ring.append(KVEvent(self._next_seq, kind, block_hash))
            self._next_seq += 1

    def since(self, seq: int, limit: int = 4096) -> KVEventBatch:
        """Up to ``limit`` events from ``seq`` on (the first call of a reader: its snapshot's
        ``next_seq``)."""
        with self._lock:
            next_seq = self._next_seq
            oldest = self._ring[0].seq if self._ring else next_seq
            if seq < oldest or seq > next_seq:
                return KVEventBatch(self.epoch, next_seq, [], resync=True)
            skip = seq - oldest
            events = list(islice(self._ring, skip, skip + limit))
        upto = events[-1].seq + 1 if events else seq
        return KVEventBatch(self.epoch, upto, events, resync=False)

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.epoch, self._next_seq, list(self._cached))
