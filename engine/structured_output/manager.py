"""The grammar engine beside the scheduler, built on xgrammar.

A request's constraint (``SamplingParams.structured_outputs``) goes through three stages:

1. **validate** (:meth:`StructuredOutputManager.check`, on the caller's thread): first the
   size limits (:mod:`engine.structured_output.limits`: bytes, depth, properties, enum
   values, repeat bounds; linear time), then the schema keywords, then the spec is turned into
   an xgrammar ``Grammar`` (schema -> EBNF, no tokenizer work; bounded by the limits), so an
   oversized or unsupported constraint is a ``ParameterError`` naming the parameter before
   anything is queued;
2. **compile** (:meth:`StructuredOutputManager.grammar_for`, in a worker process of
   :class:`~engine.structured_output.compile_pool.CompilePool`, within a time budget and a
   per-tenant share): the grammar is compiled against the tokenizer's vocabulary (the
   token-level automaton, the slow part). Compiled grammars are cached by content: the key is
   the constraint's canonical text (``StructuredOutputsParams.cache_key``); the tokenizer is
   fixed per manager, so it is part of the key implicitly. The engine loop never waits: a
   request stays out of the scheduler until ``GrammarState.is_ready``. The server awaits the
   compile (:meth:`StructuredOutputManager.prepare`) before it answers, so a compile that
   fails or runs past its budget is a 400;
3. **match** (:class:`GrammarState`, engine thread): one xgrammar matcher per sequence (so
   ``n > 1`` children each have their own), advanced with every accepted token. Each step the
   manager fills ONE int32 bitmask for all constrained rows of the batch
   (``BatchGrammarMatcher.batch_fill_next_token_bitmask``); the sampler applies it.

Preemption keeps a request's output tokens (recompute prefills prompt + output again; swap
copies the KV), and the matcher has accepted exactly those tokens, so its state stays right
without a rollback; only a token that is *discarded* would need ``GrammarState.rollback``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.sampling_params import ParameterError, StructuredOutputsParams
from engine.structured_output.compile_pool import (
    CompileError,
    CompilePool,
    CompileTimeout,
    CompileWorkerDied,
    build_grammar,
)
from engine.structured_output.limits import ConstraintLimitError, ConstraintLimits, check_limits
from engine.structured_output.schema_check import UnsupportedSchema, check_regex, check_schema

logger = logging.getLogger("portico.engine.structured_output")

# Compiled grammars kept (least recently used dropped first): distinct schemas from many
# tenants must not grow the engine's memory without bound.
MAX_CACHED_GRAMMARS = 512


@dataclass
class GrammarStats:
    """Compile counters since start (cumulative; seconds are wall time seen by the lanes)."""

    num_compiled: int = 0  # cold: compiled against the vocabulary
    num_cache_hits: int = 0  # served from the cache (or joined a compile in flight)
    compile_seconds_total: float = 0.0
    last_compile_seconds: float = 0.0
    num_failed: int = 0
    num_timed_out: int = 0  # ran past the compile budget (their workers were replaced)
    num_slow_masks: int = 0  # sequences cut because one mask took more than max_mask_ms
    tokenizer_setup_seconds: float = 0.0  # once per engine, at start, on a compile lane


class GrammarState:
    """One sequence's constraint: the compiled grammar (a future) and, once ready, its matcher.

    Engine thread only. ``is_terminated`` means the grammar has accepted its stop token: the
    output is complete and the request must end with finish_reason "stop". ``too_slow`` means
    its mask cost more than ``max_mask_ms``: the request must end (finish_reason "length")
    before its growing masks delay every sequence's step.
    """

    __slots__ = ("_future", "matcher", "error", "too_slow")

    def __init__(self, future: Future[xgr.CompiledGrammar]) -> None:
        self._future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.error: BaseException | None = None
        # Its mask took more than the limit (an ambiguous grammar): the engine cuts it.
        self.too_slow = False

    @property
    def is_ready(self) -> bool:
        """True once compiled (or failed: check ``error``); builds the matcher on first True."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            self.matcher = xgr.GrammarMatcher(self._future.result())
        except Exception as exc:  # compile error surfaced here; the request is aborted
            self.error = exc
        return True

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the compile (used only when nothing can run)."""
        try:
            self._future.exception(timeout=timeout)
        except TimeoutError:
            pass

    def accept(self, token_id: int) -> bool:
        assert self.matcher is not None  # scheduled only when ready (engine invariant)
        return bool(self.matcher.accept_token(token_id))

    def accept_all(self, token_ids: Sequence[int]) -> None:
        """Replay tokens already generated (a sibling or a rebuilt matcher)."""
        for token in token_ids:
            self.accept(token)

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if self.matcher is not None and num_tokens:
            self.matcher.rollback(num_tokens)


class StructuredOutputManager:
    """Validates, compiles (in worker processes, cached) and applies grammars for one tokenizer.

    Thread-safety: :meth:`check`, :meth:`grammar_for` and :meth:`prepare` may run on any thread
    (the cache is locked); :meth:`fill_bitmask` and :class:`GrammarState` on the engine thread
    only. :meth:`close` (or garbage collection) stops the compile workers.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_num_seqs: int,
        limits: ConstraintLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or ConstraintLimits()
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._checked: OrderedDict[str, None] = OrderedDict()  # keys that passed check()
        self._lock = threading.Lock()
        self.stats = GrammarStats()
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        self.pool = CompilePool(
            self._tokenizer_info,
            num_workers=self.limits.compile_workers,
            per_tenant=self.limits.compile_per_tenant,
            timeout_s=self.limits.compile_timeout,
        )
        # Engines built and dropped without close() (tests, notebooks) still stop their workers.
        weakref.finalize(self, self.pool.close)

    # -- validate ---------------------------------------------------------------------------

    def check(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Raise ParameterError naming ``param`` if ``spec`` passes a limit or xgrammar cannot
        build it (the cheap checks first: a huge spec is refused before any conversion)."""
        check_limits(spec, self.limits, param)
        key = spec.cache_key
        with self._lock:
            if key in self._checked:  # the server checks a spec at each stage: convert once
                return
        try:
            if spec.json is not None:
                check_schema(spec.json)
            elif spec.regex is not None:
                check_regex(spec.regex)
            build_grammar(spec)
        except UnsupportedSchema as exc:
            raise ParameterError(param, f"{param}: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ParameterError(param, _invalid(spec, param, str(exc))) from None
        with self._lock:
            self._checked[key] = None
            if len(self._checked) > MAX_CACHED_GRAMMARS:
                self._checked.popitem(last=False)

    # -- compile ----------------------------------------------------------------------------

    def grammar_for(self, spec: StructuredOutputsParams, tenant: str = "default") -> GrammarState:
        """A new matcher-to-be for ``spec``: cached if compiled before, else compiled now in
        the background, as one of ``tenant``'s compiles."""
        return GrammarState(self._compiled(spec, tenant))

    async def prepare(
        self, spec: StructuredOutputsParams, param: str, tenant: str = "default"
    ) -> None:
        """Wait (without blocking the event loop) until ``spec`` is compiled and cached.

        Raises ParameterError naming ``param``: a :class:`ConstraintLimitError` naming the
        budget if the compile ran past it, else the library's reason. Leaving early (a client
        that disconnects) does not cancel the compile, which other requests may share.
        """
        future = self._compiled(spec, tenant)
        try:
            await asyncio.shield(asyncio.wrap_future(future))
        except CompileTimeout:
            raise ConstraintLimitError(
                param, "compiling the constraint ran past its time budget and was cancelled",
                self.limits.compile_timeout, "compile_timeout",
            ) from None  # fmt: skip
        except CompileError as exc:
            raise ParameterError(param, _invalid(spec, param, str(exc))) from None

    def _compiled(self, spec: StructuredOutputsParams, tenant: str) -> Future[xgr.CompiledGrammar]:
        """The cached compile of ``spec`` (done, failed or in flight), or a new one.

        A compile that ran past its budget stays cached as failed, so the same spec is refused
        at once instead of holding a worker again; other failures are retried."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not _retryable(future):
                self.stats.num_cache_hits += 1
                self._cache.move_to_end(key)
                return future
            future = self.pool.submit(spec, tenant)
            future.add_done_callback(self._count)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)  # its live matchers keep their grammar
        return future

    def _count(self, future: Future[xgr.CompiledGrammar]) -> None:
        pool = self.pool.stats
        with self._lock:
            self.stats.num_compiled = pool.num_compiled
            self.stats.num_failed = pool.num_failed
            self.stats.num_timed_out = pool.num_timed_out
            self.stats.compile_seconds_total = pool.compile_seconds_total
            self.stats.last_compile_seconds = pool.last_compile_seconds

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        """The vocabulary's token table (about a second for a 50k vocabulary): built once, on
        a compile lane at start, so the first request does not wait for it."""
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
        )
        self.stats.tokenizer_setup_seconds = time.perf_counter() - start
        return info

    # -- match ------------------------------------------------------------------------------

    def fill_bitmask(self, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
        """One bitmask for the batch: row ``i`` holds the tokens ``states[i]`` allows next.

        Returns the bitmask (``[len(states), ceil(vocab/32)]`` int32, a view of a buffer
        reused every step) and the rows it constrains; rows without a grammar are not filled.
        """
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for i, state in enumerate(states):
            if state is not None and state.matcher is not None:
                rows.append(i)
                matchers.append(state.matcher)
        if len(states) > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        bitmask = self._bitmask[: len(states)]
        # CPU time of this thread: another process taking the core does not count.
        start = time.thread_time()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        if time.thread_time() - start > self.limits.max_mask_ms / 1000:
            self._find_slow(states, rows, bitmask)
        return bitmask, rows

    def _find_slow(
        self, states: Sequence[GrammarState | None], rows: list[int], bitmask: torch.Tensor
    ) -> None:
        """The batch's mask took too long: time each row again (a fill does not move the
        matcher) and mark the rows over the limit. Only paid in that rare case."""
        for row in rows:
            state = states[row]
            assert state is not None and state.matcher is not None  # rows hold matchers
            start = time.thread_time()
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if time.thread_time() - start > self.limits.max_mask_ms / 1000:
                self._mark_slow(state)

    def _mark_slow(self, state: GrammarState) -> None:
        if not state.too_slow:
            state.too_slow = True
            self.stats.num_slow_masks += 1
            logger.warning(
                "a grammar's mask took more than %g ms of CPU: its request is cut",
                self.limits.max_mask_ms,
            )

    def fill_bitmask_for_guesses(
        self, states: Sequence[GrammarState | None], guesses: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """The bitmask for a step that verifies guesses (speculative decoding): request ``i``
        owns ``1 + len(guesses[i])`` consecutive rows, and its row ``j`` holds what its grammar
        allows after ``guesses[i][:j]``. The matcher is advanced through the guesses and rolled
        back. Rows after a guess the grammar refuses (or after the grammar ends) stay
        unconstrained: the target can never sample the refused guess from the masked row
        before them, so they are never used.
        """
        total = sum(1 + len(g) for g in guesses)
        if total > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(total, self.vocab_size)
        bitmask = self._bitmask[:total]
        rows: list[int] = []
        base = 0
        for state, guess in zip(states, guesses, strict=True):
            matcher = state.matcher if state is not None else None
            if state is not None and matcher is not None:
                start = time.thread_time()
                num_advanced = 0
                for j in range(len(guess) + 1):
                    if matcher.is_terminated():
                        break
                    matcher.fill_next_token_bitmask(bitmask, base + j)
                    rows.append(base + j)
                    if j == len(guess) or not matcher.accept_token(guess[j]):
                        break
                    num_advanced += 1
                if num_advanced:
                    matcher.rollback(num_advanced)
                if time.thread_time() - start > self.limits.max_mask_ms / 1000 * (1 + len(guess)):
                    self._mark_slow(state)
            base += 1 + len(guess)
        return bitmask, rows

    def close(self) -> None:
        """Stop the compile workers; queued compiles fail."""
        self.pool.close()


def _retryable(future: Future[xgr.CompiledGrammar]) -> bool:
    """A failed compile worth running again (not one that ran past its budget)."""
    if not future.done() or future.cancelled():
        return future.cancelled()
    exc = future.exception()
    if exc is None or isinstance(exc, CompileTimeout):
        return False
    return isinstance(exc, CompileWorkerDied) or not isinstance(exc, CompileError)


def _invalid(spec: StructuredOutputsParams, param: str, reason: str) -> str:
    """The 400's sentence for a constraint the grammar library refused."""
    # xgrammar prefixes "[time] file.cc:line: "; keep the sentence after it.
    text = reason.strip().splitlines()[0] if reason.strip() else "unknown error"
    message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    return f"{param}: unsupported or invalid {spec.kind} constraint: {message}"
