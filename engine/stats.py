"""A snapshot of the engine's gauges and counters, for ``/metrics`` and for tests.

Counters are cumulative since the engine started (Prometheus counters take deltas or use the
value directly); gauges describe the moment the snapshot was taken.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.scheduler import SchedulerStats
    from engine.spec_decode.speculator import SpecDecodeStats
    from engine.structured_output.manager import GrammarStats


@dataclass(frozen=True)
class TenantStats:
    """One tenant's share of the engine at a step boundary (engine/tenancy.py).

    Gauges: ``num_waiting``, ``num_running`` (requests), ``num_kv_blocks`` (GPU blocks its
    requests hold, each once), ``num_slot_share`` (running slots the fair policy owes it now
    while tenants contend; 0 when it has no work or the policy keeps no shares).
    Counters: ``num_prompt_tokens`` / ``num_generation_tokens``,
    tokens scheduled for it (prefill chunks, recomputation included / decodes and guesses).
    """

    name: str
    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks: int = 0
    num_slot_share: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """One consistent reading of the engine (taken at a step boundary).

    Gauges: ``num_running``, ``num_waiting``, ``num_swapped`` (requests, counting each of the
    ``n`` children of a request), ``kv_cache_usage`` (fraction of KV blocks in use, 0..1),
    ``num_free_blocks`` / ``num_total_blocks``.
    Counters: ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up in and
    found in the prefix cache), ``num_preemptions``, ``num_prompt_tokens`` (prompt tokens of
    requests admitted), ``num_computed_prompt_tokens`` (prompt-or-recomputed tokens actually run
    through the model: prefill work), ``num_generation_tokens`` (tokens sampled),
    ``num_steps``, ``num_requests_finished`` by reason (``finished_stop``, ``finished_length``,
    ``finished_abort``).
    Structured outputs: ``num_waiting_for_grammar`` (gauge: requests whose grammar is still
    compiling), ``grammar_compiles`` / ``grammar_cache_hits`` (cold compiles / requests served
    a cached grammar) and ``grammar_compile_seconds`` (total seconds spent compiling).
    Speculative decoding (all 0 / empty when off): ``spec_decode_num_drafts`` (request-steps
    that verified guesses), ``spec_decode_num_draft_tokens`` (guesses verified),
    ``spec_decode_num_accepted_tokens`` (guesses accepted), and per guess position ``j``
    ``spec_decode_num_accepted_tokens_per_pos[j]`` (drafts whose guess ``j`` was accepted).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    finished_abort: int = 0
    # LoRA (vLLM's lora_requests_info): adapter names of running / waiting requests
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    resident_lora_adapters: tuple[str, ...] = ()  # in a LoRA slot now (a router prefers these)
    max_lora: int = 0
    num_waiting_for_grammar: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    tenants: tuple[TenantStats, ...] = ()  # per tenant: see TenantStats


def engine_stats(
    sched: SchedulerStats,
    grammar: GrammarStats,
    spec: SpecDecodeStats | None,
    counters: Mapping[str, int],
    *,
    lora_names: tuple[tuple[str, ...], tuple[str, ...]],
    max_lora: int,
    num_waiting_for_grammar: int,
    resident_lora_adapters: tuple[str, ...] = (),
) -> EngineStats:
    """One :class:`EngineStats` from the parts' own readings: the scheduler's, the grammar
    compiler's, the speculator's (None when off), the engine's ``counters`` (named as
    :class:`EngineStats`' fields), the running / waiting adapter names and those in slots."""
    running, waiting = lora_names
    stats = EngineStats(
        running_lora_adapters=running,
        waiting_lora_adapters=waiting,
        resident_lora_adapters=resident_lora_adapters,
        max_lora=max_lora,
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_swapped=sched.num_swapped,
        kv_cache_usage=sched.kv_cache_usage,
        num_free_blocks=sched.num_gpu_blocks - sched.num_used_gpu_blocks,
        num_total_blocks=sched.num_gpu_blocks,
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits,
        num_preemptions=sched.num_preemptions,
        tenants=sched.tenants,
        num_waiting_for_grammar=num_waiting_for_grammar,
        grammar_compiles=grammar.num_compiled,
        grammar_cache_hits=grammar.num_cache_hits,
        grammar_compile_seconds=grammar.compile_seconds_total,
        spec_decode_num_accepted_tokens_per_pos=(),  # set below when speculating
        **counters,
    )
    if spec is None:
        return stats
    return dataclasses.replace(
        stats,
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
    )


class StatsLogger:
    """The engine's periodic log line (vLLM's): throughput, queues, KV cache use, prefix-cache
    hit rate, and with speculative decoding the acceptance rate, every ``interval_s`` seconds
    while the engine works. Fed the snapshot taken after each step; logs nothing while idle."""

    def __init__(self, interval_s: float = 10.0, logger: logging.Logger | None = None) -> None:
        self.interval_s = interval_s
        self.logger = logger or logging.getLogger("portico.engine")
        self._last: EngineStats | None = None
        self._last_time = time.monotonic()

    def observe(self, stats: EngineStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is None:
            self._last, self._last_time = stats, now
            return
        if now - self._last_time < self.interval_s:
            return
        if stats.num_steps != self._last.num_steps:
            for line in format_stats(self._last, stats, now - self._last_time):
                self.logger.info("%s", line)
        self._last, self._last_time = stats, now


def format_stats(prev: EngineStats, cur: EngineStats, seconds: float) -> list[str]:
    """The log lines for the interval between two snapshots ``seconds`` apart."""
    seconds = max(seconds, 1e-9)
    queries = cur.prefix_cache_queries - prev.prefix_cache_queries
    hits = cur.prefix_cache_hits - prev.prefix_cache_hits
    lines = [
        f"Avg prompt throughput: "
        f"{(cur.num_computed_prompt_tokens - prev.num_computed_prompt_tokens) / seconds:.1f} "
        f"tokens/s, Avg generation throughput: "
        f"{(cur.num_generation_tokens - prev.num_generation_tokens) / seconds:.1f} tokens/s, "
        f"Running: {cur.num_running} reqs, Waiting: {cur.num_waiting} reqs, "
        f"KV cache usage: {cur.kv_cache_usage * 100:.1f}%, "
        f"Prefix cache hit rate: {hits / queries * 100 if queries else 0.0:.1f}%"
    ]
    drafts = cur.spec_decode_num_drafts - prev.spec_decode_num_drafts
    if cur.spec_decode_num_accepted_tokens_per_pos:
        drafted = cur.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
        accepted = cur.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
        before = prev.spec_decode_num_accepted_tokens_per_pos or (0,) * len(
            cur.spec_decode_num_accepted_tokens_per_pos
        )
        per_pos = [
            (c - p) / drafts if drafts else 0.0
            for c, p in zip(cur.spec_decode_num_accepted_tokens_per_pos, before, strict=True)
        ]
        lines.append(
            f"SpecDecoding metrics: Draft acceptance rate: "
            f"{accepted / drafted * 100 if drafted else 0.0:.1f}%, "
            f"Mean acceptance length: {1 + accepted / drafts if drafts else 1.0:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}"
        )
    return lines
