"""The grammar engine beside the scheduler, built on xgrammar.

A request's constraint (``SamplingParams.structured_outputs``) goes through three stages:

1. **validate** (:meth:`StructuredOutputManager.check`, on the caller's thread): the spec is
   turned into an xgrammar ``Grammar`` (schema -> EBNF, no tokenizer work, milliseconds), so an
   unsupported schema feature or a bad regex is a ``ParameterError`` naming the parameter
   before anything is queued;
2. **compile** (:meth:`StructuredOutputManager.grammar_for`, on one background thread): the
   grammar is compiled against the tokenizer's vocabulary (the token-level automaton, the
   slow part). Compiled grammars are cached by content: the key is the constraint's canonical
   text (``StructuredOutputsParams.cache_key``); the tokenizer is fixed per manager, so it is
   part of the key implicitly. The engine loop never waits: a request stays out of the
   scheduler until ``GrammarState.is_ready``;
3. **match** (:class:`GrammarState`, engine thread): one xgrammar matcher per sequence (so
   ``n > 1`` children each have their own), advanced with every accepted token. Each step the
   manager fills ONE int32 bitmask for all constrained rows of the batch
   (``BatchGrammarMatcher.batch_fill_next_token_bitmask``); the sampler applies it.

Preemption keeps a request's output tokens (recompute prefills prompt + output again; swap
copies the KV), and the matcher has accepted exactly those tokens, so its state stays right
without a rollback; only a token that is *discarded* would need ``GrammarState.rollback``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.sampling_params import ParameterError, StructuredOutputsParams
from engine.structured_output.schema_check import UnsupportedSchema, check_regex, check_schema

logger = logging.getLogger("portico.engine.structured_output")

# Whitespace characters allowed between two JSON tokens. Unbounded, a small model at a high
# temperature can spend all of max_tokens on spaces and newlines; 16 still admits pretty
# printing (a newline and a deep indent).
MAX_JSON_WHITESPACE = 16
# Compiled grammars kept (least recently used dropped first): distinct schemas from many
# tenants must not grow the engine's memory without bound.
MAX_CACHED_GRAMMARS = 512


@dataclass
class GrammarStats:
    """Compile counters since start (cumulative; seconds are wall time of the compile thread)."""

    num_compiled: int = 0  # cold: compiled against the vocabulary
    num_cache_hits: int = 0  # served from the cache (or joined a compile in flight)
    compile_seconds_total: float = 0.0
    last_compile_seconds: float = 0.0
    num_failed: int = 0
    tokenizer_setup_seconds: float = 0.0  # once per engine, at start, on the compile thread


class GrammarState:
    """One sequence's constraint: the compiled grammar (a future) and, once ready, its matcher.

    Engine thread only. ``is_terminated`` means the grammar has accepted its stop token: the
    output is complete and the request must end with finish_reason "stop".
    """

    __slots__ = ("_future", "matcher", "error")

    def __init__(self, future: Future[xgr.CompiledGrammar]) -> None:
        self._future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.error: BaseException | None = None

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
    """Validates, compiles (in the background, cached) and applies grammars for one tokenizer.

    Thread-safety: :meth:`check` may run on any thread; :meth:`grammar_for` on any thread (the
    cache is locked); :meth:`fill_bitmask` and :class:`GrammarState` on the engine thread only.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_num_seqs: int,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on the compile thread
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)
        self.stats = GrammarStats()
        self._executor.submit(self._ensure_compiler)

    # -- validate ---------------------------------------------------------------------------

    def check(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Raise ParameterError naming ``param`` if xgrammar cannot build this constraint."""
        try:
            if spec.json is not None:
                check_schema(spec.json)
            elif spec.regex is not None:
                check_regex(spec.regex)
            self._grammar(spec)
        except UnsupportedSchema as exc:
            raise ParameterError(param, f"{param}: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar prefixes "[time] file.cc:line: "; keep the sentence after it.
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
            raise ParameterError(
                param, f"{param}: unsupported or invalid {spec.kind} constraint: {message}"
            ) from None

    @staticmethod
    def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
        any_ws = not spec.disable_any_whitespace
        ws = MAX_JSON_WHITESPACE if any_ws else None
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, dict) else {}
            if spec.json is False:
                raise ValueError("the schema `false` matches nothing")
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=any_ws, strict_mode=True, max_whitespace_cnt=ws
            )
        if spec.json_object:
            return xgr.Grammar.from_json_schema(
                {"type": "object"}, any_whitespace=any_ws, max_whitespace_cnt=ws
            )
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice)
            )
        assert spec.grammar is not None  # StructuredOutputsParams sets exactly one
        return xgr.Grammar.from_ebnf(spec.grammar)

    # -- compile ----------------------------------------------------------------------------

    def grammar_for(self, spec: StructuredOutputsParams) -> GrammarState:
        """A new matcher-to-be for ``spec``: cached if compiled before, else compiled now in
        the background."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.stats.num_cache_hits += 1
                self._cache.move_to_end(key)
            else:
                future = self._executor.submit(self._compile, spec)
                self._cache[key] = future
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)  # its live matchers keep their grammar
        return GrammarState(future)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._ensure_compiler()
        start = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(self._grammar(spec))
        except Exception:
            with self._lock:
                self.stats.num_failed += 1
            logger.exception("grammar compile failed (%s)", spec.kind)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.num_compiled += 1
            self.stats.compile_seconds_total += seconds
            self.stats.last_compile_seconds = seconds
        logger.info("compiled a %s grammar in %.1f ms", spec.kind, seconds * 1000)
        return compiled

    def _ensure_compiler(self) -> xgr.GrammarCompiler:
        """The vocabulary's token table (about a second for a 50k vocabulary): built once, on
        the compile thread, queued at start so the first request does not wait for it."""
        if self._compiler is None:
            start = time.perf_counter()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            # cache_enabled=False: our cache (by content) is the one cache.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self.stats.tokenizer_setup_seconds = time.perf_counter() - start
        return self._compiler

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
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return bitmask, rows

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
            if matcher is not None:
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
            base += 1 + len(guess)
        return bitmask, rows

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON escaping is what xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)
