"""A snapshot of the engine's gauges and counters, for ``/metrics`` and for tests.

Counters are cumulative since the engine started (Prometheus counters take deltas or use the
value directly); gauges describe the moment the snapshot was taken.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    max_lora: int = 0
    num_waiting_for_grammar: int = 0
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
