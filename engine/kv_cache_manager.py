"""Which KV blocks each request holds: prefix-cache lookup, slot allocation, free, and swap."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool, KVBlock
from engine.kv_events import KVEventLog
from engine.multimodal import block_image_keys
from engine.request import Request
from portico.contract import block_extra, hash_block_tokens, split_salt

KV_EVENT_CAPACITY = 16384  # block events kept for pollers (~2 MB); a slower reader resyncs


@dataclass
class KVCacheStats:
    """A snapshot of the KV cache, read by the metrics exporters. Token counts are cumulative."""

    num_gpu_blocks: int
    num_used_gpu_blocks: int
    usage: float  # num_used_gpu_blocks / num_gpu_blocks
    num_cpu_blocks: int
    num_used_cpu_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found cached


class KVCacheManager:
    """Maps requests to KV blocks of a :class:`BlockPool`; the policy-free half of scheduling.

    Promises: a request's blocks cover ``block_ids[p // block_size]`` for every position it has
    been given slots for; only full blocks whose KV has been computed are hashed into the prefix
    cache; a prefix lookup never covers the last token of a request (it is always computed, so
    there are logits to sample from). ``allocate_slots`` returns None instead of choosing a
    victim: preemption is the scheduler's decision. With ``num_cpu_blocks`` > 0 it also keeps a
    CPU pool for preemption by swapping.

    Each GPU block a request holds is charged to the request's tenant, once per tenant however
    many of its requests share it (a prefix-cache hit is charged to every tenant holding it;
    a cached block nobody holds is charged to no one): :meth:`num_tenant_blocks`. Not
    thread-safe.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        hash_seed: bytes | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Stored/evicted hashes for the gateway's prefix index (engine/kv_events.py).
        self.events = KVEventLog(KV_EVENT_CAPACITY) if enable_caching else None
        self.pool = BlockPool(num_gpu_blocks, enable_caching, self.events)
        # A random root per process: hashes (and cache timing) are not predictable from outside.
        self.root_hash = hash_seed if hash_seed is not None else os.urandom(32)
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free = list(range(num_cpu_blocks - 1, -1, -1))
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # leading blocks already registered
        self._req_cpu_blocks: dict[str, list[int]] = {}
        # tenant -> block id -> how many of the tenant's requests hold it
        self._tenant_refs: dict[str, dict[int, int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- prefix cache ------------------------------------------------------------------------

    def _hash_full_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend ``request.block_hashes`` to its first ``num_blocks`` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        salt, num_shared, shared_salt = None, 0, ""
        if len(hashes) < num_blocks:
            salt, num_shared, shared_salt = split_salt(request.cache_salt, bs)
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else None
        images = request.mm_inputs
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else self.root_hash
            extra = block_extra(i, salt, num_shared, shared_salt, lora_id)
            if images:  # an image's tokens are keyed by its content, not the placeholder id
                extra += block_image_keys(images, i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Cached blocks of the request's longest cached prefix, and how many tokens they hold.

        Never the whole request: at most ``(num_tokens - 1) // block_size`` blocks.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._hash_full_blocks(request, max_blocks)
        hits: list[KVBlock] = []
        cached = self.pool.cached
        for i in range(max_blocks):
            block = cached.get(request.block_hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (a retried admission is counted once)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_computed_tokens`` tokens."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._hash_full_blocks(request, num_full)
        blocks = self._req_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_hashed_blocks[request.request_id] = num_full

    # -- allocation --------------------------------------------------------------------------

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[KVBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens, or return None.

        ``new_computed_blocks`` are prefix-cache hits from :meth:`get_computed_blocks`, taken
        (referenced) together with the new blocks; on None nothing changed.
        """
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            blocks = self._req_blocks[request.request_id] = []
        num_hits = len(new_computed_blocks)
        num_tokens = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        num_new_blocks = -(-num_tokens // self.block_size) - len(blocks) - num_hits
        if num_hits:
            # Hits sitting in the free queue stop being allocatable once we reference them.
            num_free = self.pool.num_free - sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > num_free:
                return None
            self.pool.touch(new_computed_blocks)
            self._charge(request, new_computed_blocks)
            blocks.extend(new_computed_blocks)
            request.block_ids.extend(b.block_id for b in new_computed_blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.pool.num_free:
            return None
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        self._charge(request, new_blocks)
        blocks.extend(new_blocks)
        request.block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block the request holds (GPU and CPU). Idempotent."""
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))  # tail first: evicted before the prefix
            self._uncharge(request, blocks)
        self._num_hashed_blocks.pop(request.request_id, None)
        cpu_blocks = self._req_cpu_blocks.pop(request.request_id, None)
        if cpu_blocks:
            self._cpu_free.extend(cpu_blocks)
        request.block_ids = []

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` tokens' (slots given to guesses the
        target rejected). They were never hashed: only computed full blocks are."""
        blocks = self._req_blocks.get(request.request_id)
        keep = self.num_blocks_for_tokens(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        self.pool.free_blocks(reversed(blocks[keep:]))
        self._uncharge(request, blocks[keep:])
        del blocks[keep:]
        del request.block_ids[keep:]

    # -- swap (preemption mode "swap") -------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the CPU pool: (gpu_block, cpu_block) pairs to copy.

        The GPU blocks are freed at once; the model runner must copy them before this step's
        forward pass writes anything. None (and no change) when the CPU pool is too small.
        """
        blocks = self._req_blocks.get(request.request_id, [])
        if len(blocks) > len(self._cpu_free):
            return None
        cpu_ids = [self._cpu_free.pop() for _ in blocks]
        pairs = [(b.block_id, c) for b, c in zip(blocks, cpu_ids, strict=True)]
        self.free(request)
        self._req_cpu_blocks[request.request_id] = cpu_ids
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back with room for ``num_new_tokens`` more tokens.

        Returns (cpu_block, gpu_block) pairs to copy before the step, or None if the GPU pool
        lacks blocks (nothing changes). The CPU blocks are released.
        """
        cpu_ids = self._req_cpu_blocks[request.request_id]
        num_needed = max(
            self.num_blocks_for_tokens(request.num_computed_tokens + num_new_tokens), len(cpu_ids)
        )
        if num_needed > self.pool.num_free:
            return None
        new_blocks = self.pool.get_new_blocks(num_needed)
        self._charge(request, new_blocks)
        self._req_blocks[request.request_id] = new_blocks
        self._num_hashed_blocks.pop(request.request_id, None)  # re-registered after the step
        request.block_ids = [b.block_id for b in new_blocks]
        del self._req_cpu_blocks[request.request_id]
        self._cpu_free.extend(cpu_ids)
        return [(c, b.block_id) for c, b in zip(cpu_ids, new_blocks, strict=False)]

    # -- per-tenant charge --------------------------------------------------------------------

    def _charge(self, request: Request, blocks: Sequence[KVBlock]) -> None:
        refs = self._tenant_refs.setdefault(request.tenant.name, {})
        for block in blocks:
            refs[block.block_id] = refs.get(block.block_id, 0) + 1

    def _uncharge(self, request: Request, blocks: Sequence[KVBlock]) -> None:
        name = request.tenant.name
        refs = self._tenant_refs[name]
        for block in blocks:
            left = refs[block.block_id] - 1
            if left:
                refs[block.block_id] = left
            else:
                del refs[block.block_id]
        if not refs:
            del self._tenant_refs[name]

    def num_tenant_blocks(self, tenant: str) -> int:
        """GPU blocks the tenant's requests hold (each block counted once)."""
        refs = self._tenant_refs.get(tenant)
        return len(refs) if refs else 0

    def tenant_blocks(self) -> dict[str, int]:
        """GPU blocks held per tenant, for tenants that hold any."""
        return {name: len(refs) for name, refs in self._tenant_refs.items()}

    def num_swapped_blocks(self, request: Request) -> int:
        return len(self._req_cpu_blocks.get(request.request_id, ()))

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_gpu_blocks=self.pool.num_blocks,
            num_used_gpu_blocks=self.pool.num_used,
            usage=self.pool.usage(),
            num_cpu_blocks=self.num_cpu_blocks,
            num_used_cpu_blocks=self.num_cpu_blocks - len(self._cpu_free),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )
