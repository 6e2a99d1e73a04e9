"""Which requests run this step, and how many tokens each: one token-budget loop."""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import ParameterError


@dataclass
class SchedulerOutput:
    """One step's plan, carried out by the model runner.

    ``scheduled`` lists (request, num_new_tokens), decodes first, then prefill chunks; a
    request's new tokens are ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``.
    The runner copies ``swap_out`` pairs, then ``swap_in`` pairs, before the forward pass.
    ``block_tables`` values are the requests' live ``block_ids`` lists: read, never mutate.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """A snapshot for metrics (Prometheus, logs). Counters are cumulative since start."""

    num_running: int
    num_waiting: int  # includes swapped-out requests
    num_swapped: int
    num_gpu_blocks: int
    num_used_gpu_blocks: int
    kv_cache_usage: float  # fraction of GPU blocks in use, 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int


class Scheduler:
    """Decides each step's batch within ``max_num_batched_tokens`` and ``max_num_seqs``.

    Order: running requests (oldest first; decode tokens are reserved before prefill chunks),
    then waiting ones by (priority, arrival). When a running request cannot get a block, the
    newest running request (largest (priority, arrival)) is preempted: swapped to the CPU pool
    in mode "swap" (when it fits), else recomputed: its blocks are freed and it re-enters the
    waiting queue with its output kept, to be prefilled again as prompt + output. A request the
    pool could never hold is refused by :meth:`check_fits` before it is added, so the loop never
    livelocks. Token-level stops are decided here (see :meth:`update_from_output`); stop
    strings are the engine loop's, which calls :meth:`finish_request`. Not thread-safe.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_gpu_blocks: int,
        *,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
        num_cpu_blocks: int = 0,
        hash_seed: bytes | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(
            num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks if config.preemption_mode == "swap" else 0,
            hash_seed=hash_seed,
        )
        self.requests: dict[str, Request] = {}
        # Waiting: a heap of (priority, arrival, seq, request); seq breaks ties FIFO.
        self.waiting: list[tuple[int, float, int, Request]] = []
        # Running: sorted by (priority, arrival, seq) so the newest is last and pops in O(1).
        self.running: list[Request] = []
        self._order: dict[str, tuple[int, float, int]] = {}
        self._seq = 0
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> None:
        """Raise ParameterError (a ValueError) if such a request could never complete."""
        if prompt_len < 1:
            raise ParameterError("prompt", "prompt must contain at least one token")
        if prompt_len >= self.max_model_len:
            raise ParameterError(
                "prompt",
                f"prompt is {prompt_len} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, including at least one generated token",
            )
        total = prompt_len + (max_tokens or self.max_model_len - prompt_len)
        if total > self.max_model_len:
            raise ParameterError(
                "max_tokens",
                f"this model's maximum context length is {self.max_model_len} tokens; you "
                f"requested {total} ({prompt_len} in the prompt, {max_tokens} in max_tokens)",
            )
        # The last sampled token's KV is never written: total - 1 tokens need slots.
        num_blocks = self.kv.num_blocks_for_tokens(total - 1)
        pool_blocks = self.kv.pool.num_blocks
        if num_blocks > pool_blocks:
            raise ParameterError(
                "max_tokens",
                f"prompt + max_tokens = {total} tokens needs {num_blocks} KV blocks; the KV "
                f"cache holds {pool_blocks} ({pool_blocks * self.config.block_size} tokens). "
                "Lower max_tokens or raise --kv-cache-memory",
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and prompt_len > budget:
            raise ParameterError(
                "prompt",
                f"prompt is {prompt_len} tokens; without chunked prefill it must fit in "
                f"--max-num-batched-tokens ({budget})",
            )

    def add_request(self, request: Request) -> None:
        """Queue a request (already checked with :meth:`check_fits`)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._seq += 1
        key = (request.priority, request.arrival_time, self._seq)
        self._order[request.request_id] = key
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (*key, request))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results; return the requests that finished in it."""
        raise NotImplementedError

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (abort, or a stop string) and free its blocks. Unknown id: no-op."""
        raise NotImplementedError

    @property
    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        num_swapped = sum(1 for *_, r in self.waiting if r.status == RequestStatus.SWAPPED)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=num_swapped,
            num_gpu_blocks=kv.num_gpu_blocks,
            num_used_gpu_blocks=kv.num_used_gpu_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )


_ = (bisect, time)
