"""Grammar compiles under a time budget that is enforced, and a fair share per tenant.

A compile runs C++ code that cannot be interrupted, and a thread cannot be cancelled, so a
compile that runs away would hold its thread (and every compile queued behind it) for good.
Each compile therefore runs first in a worker process, as a trial: the lane thread that handed
it over waits at most ``timeout_s`` for the verdict, then kills the worker, starts a fresh one
and fails the compile with :class:`CompileTimeout`. A spec whose trial finished is compiled
again on the lane thread, in the engine's process (xgrammar releases the GIL while it
compiles), which takes about as long as the trial did: it is known to end. The result is not
shipped back from the worker because serialized grammars are huge (a 1000-property schema's
``CompiledGrammar.serialize_json`` is 280 MB and takes 20 s), so a cold compile costs twice
its CPU time; compiled grammars are cached by the caller.

Workers are forked from a fork server (``multiprocessing``'s ``forkserver``) that imported
this module, and with it xgrammar, once: a replacement worker starts in milliseconds, and no
worker is forked from the engine process itself, whose threads may hold locks. The main
module of the process must be import-safe (``if __name__ == "__main__":``), as for any use
of ``multiprocessing`` outside ``fork``.

Fairness: jobs queue per tenant and the lanes take them round-robin across tenants, with at
most ``per_tenant`` of one tenant's jobs running at once. With ``num_workers`` > ``per_tenant``
a tenant whose compiles all time out never holds every lane, so others' compiles go on.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger("portico.engine.structured_output")

# Whitespace characters allowed between two JSON tokens. Unbounded, a small model at a high
# temperature can spend all of max_tokens on spaces and newlines; 16 still admits pretty
# printing (a newline and a deep indent).
MAX_JSON_WHITESPACE = 16
# A worker's start: the fork server's first start imports xgrammar and torch (seconds on a
# busy small machine); later forks take milliseconds plus the vocabulary's tables.
WORKER_START_TIMEOUT_S = 120.0
# close() waits for a lane at most its compile's trial and rerun (2 x timeout_s) plus this
# (the vocabulary build a lane starts with).
LANE_JOIN_SLACK_S = 60.0


class CompileTimeout(Exception):
    """The compile ran past the budget; its worker was killed."""


class CompileError(Exception):
    """The grammar library refused the constraint (the message is its sentence)."""


class CompileWorkerDied(CompileError):
    """The worker died mid-compile (killed, out of memory); trying again may succeed."""


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as an xgrammar ``Grammar`` (no tokenizer work)."""
    any_ws = not spec.disable_any_whitespace
    ws = MAX_JSON_WHITESPACE if any_ws else None
    if spec.json is not None:
        if spec.json is False:
            raise ValueError("the schema `false` matches nothing")
        schema = spec.json if isinstance(spec.json, dict) else {}
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
        literals = (json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
    if spec.grammar is None:
        raise ValueError("the constraint sets none of json, json_object, regex, choice, grammar")
    return xgr.Grammar.from_ebnf(spec.grammar)


def _serve(conn: multiprocessing.connection.Connection, tokenizer_info_json: str) -> None:
    """A worker's loop: receive a spec, send back ("ok", serialized grammar) or ("error", why)."""
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            compiler.compile_grammar(build_grammar(spec))
            conn.send(("ok", ""))
        except Exception as exc:  # the library's refusal goes back as a sentence
            conn.send(("error", str(exc) or repr(exc)))


@dataclass
class _Job:
    tenant: str
    spec: StructuredOutputsParams
    future: Future[xgr.CompiledGrammar]


@dataclass
class _Worker:
    process: Any  # multiprocessing's Process of the forkserver context
    conn: multiprocessing.connection.Connection

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


@dataclass
class PoolStats:
    """Counters since start (cumulative; seconds are wall time seen by the lanes)."""

    num_compiled: int = 0
    num_failed: int = 0
    num_timed_out: int = 0
    num_workers_replaced: int = 0
    compile_seconds_total: float = 0.0
    last_compile_seconds: float = 0.0


class CompilePool:
    """``num_workers`` lanes: a thread each, with its trial worker process and its compiler.

    Promises: :meth:`submit` never blocks; its future ends with the compiled grammar, or
    :class:`CompileTimeout` (after ``timeout_s`` of compiling), or :class:`CompileError`. At
    most ``per_tenant`` jobs of one tenant compile at once; tenants are served round-robin.
    Thread-safe. ``tokenizer_info`` is a callable so the (seconds long) vocabulary setup runs
    on the first lane, not on the caller's thread.
    """

    def __init__(
        self,
        tokenizer_info: Callable[[], xgr.TokenizerInfo],
        *,
        num_workers: int,
        per_tenant: int,
        timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant
        self.stats = PoolStats()
        self._make_info = tokenizer_info
        self._info: xgr.TokenizerInfo | None = None
        self._info_json: str | None = None
        self._info_lock = threading.Lock()
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._workers: list[_Worker | None] = [None] * num_workers
        self._compilers: list[xgr.GrammarCompiler | None] = [None] * num_workers
        self._lanes = [
            threading.Thread(target=self._lane, args=(i,), name=f"grammar-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for lane in self._lanes:
            lane.start()

    # -- the caller's side ------------------------------------------------------------------

    def submit(self, spec: StructuredOutputsParams, tenant: str) -> Future[xgr.CompiledGrammar]:
        future: Future[xgr.CompiledGrammar] = Future()
        with self._cond:
            if self._closed:
                future.set_exception(CompileError("the engine is shutting down"))
                return future
            self._queues.setdefault(tenant, deque()).append(_Job(tenant, spec, future))
            self._cond.notify()
        return future

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """The vocabulary's token table (built once, on first use)."""
        with self._info_lock:
            if self._info is None:
                self._info = self._make_info()
                self._info_json = self._info.serialize_json()
            return self._info

    def close(self) -> None:
        """Fail what is queued, stop the lanes and kill the workers; wait for the lanes.

        Why wait: a lane may be inside xgrammar (the vocabulary build each pool starts with
        takes seconds, and a compile cannot be interrupted). The engine's finalizer calls this
        at interpreter exit, and a daemon thread still in xgrammar's C++ when the interpreter
        finalizes aborts the whole process ("terminate called without an active exception",
        exit status 134): a script that builds an engine and ends within seconds died so."""
        with self._cond:
            self._closed = True
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cond.notify_all()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompileError("the engine is shutting down"))
        deadline = time.monotonic() + 2 * self.timeout_s + LANE_JOIN_SLACK_S
        for lane in self._lanes:
            if lane is not threading.current_thread():
                lane.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- the lanes --------------------------------------------------------------------------

    def _next_job(self) -> _Job | None:
        """The oldest job of the first tenant (round-robin) under its cap; None once closed."""
        with self._cond:
            while not self._closed:
                for tenant, queue in self._queues.items():
                    if self._running.get(tenant, 0) < self.per_tenant:
                        job = queue.popleft()
                        if not queue:
                            del self._queues[tenant]
                        else:
                            self._queues.move_to_end(tenant)
                        if not job.future.set_running_or_notify_cancel():
                            break  # cancelled while queued: look again
                        self._running[tenant] = self._running.get(tenant, 0) + 1
                        return job
                else:
                    self._cond.wait()
            return None

    def _lane(self, index: int) -> None:
        try:
            try:  # the vocabulary, before the first request; the fork server starts with
                # the first compile (seconds, once), so engines that never compile pay nothing
                self.tokenizer_info()
            except Exception:
                logger.exception("could not prepare grammar compiles (retried per job)")
            while True:
                job = self._next_job()
                if job is None:
                    return
                try:
                    job.future.set_result(self._run_job(index, job.spec))
                except BaseException as exc:
                    job.future.set_exception(exc)
                finally:
                    with self._cond:
                        self._running[job.tenant] -= 1
                        if not self._running[job.tenant]:
                            del self._running[job.tenant]
                        self._cond.notify_all()
        finally:
            worker = self._workers[index]
            if worker is not None:
                worker.kill()

    def _run_job(self, index: int, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Try ``spec`` on lane ``index``'s worker within the budget; then compile it here."""
        info = self.tokenizer_info()
        compiler = self._compilers[index]
        if compiler is None:
            compiler = self._compilers[index] = xgr.GrammarCompiler(
                info, max_threads=1, cache_enabled=False
            )
        worker = self._workers[index]
        if worker is None or not worker.process.is_alive():
            worker = self._workers[index] = self._start_worker()
        start = time.perf_counter()
        try:
            worker.conn.send(spec)
            if not worker.conn.poll(self.timeout_s):
                raise CompileTimeout(f"the compile took longer than {self.timeout_s:g} s")
            status, payload = worker.conn.recv()
        except CompileTimeout:
            self._replace(index)
            self.stats.num_timed_out += 1
            raise
        except (EOFError, OSError) as exc:  # the worker died (killed, out of memory)
            self._replace(index)
            self.stats.num_failed += 1
            raise CompileWorkerDied(f"the compile worker died ({exc!r})") from None
        if status != "ok":
            self.stats.num_failed += 1
            raise CompileError(payload)
        compiled = compiler.compile_grammar(build_grammar(spec))
        seconds = time.perf_counter() - start
        self.stats.num_compiled += 1
        self.stats.compile_seconds_total += seconds
        self.stats.last_compile_seconds = seconds
        logger.info("compiled a %s grammar in %.1f ms", spec.kind, seconds * 1000)
        return compiled

    def _replace(self, index: int) -> None:
        worker = self._workers[index]
        self._workers[index] = None  # the next job starts a fresh one
        if worker is not None:
            worker.kill()
            self.stats.num_workers_replaced += 1

    def _start_worker(self) -> _Worker:
        """A worker for this lane, started at its first job, forked from the fork server
        (started by the engine's first compile: an engine that never compiles starts none)."""
        context = _fork_server()
        parent, child = context.Pipe()
        assert self._info_json is not None  # tokenizer_info() ran first
        process = context.Process(
            target=_serve, args=(child, self._info_json), name="portico-grammar", daemon=True
        )
        process.start()
        child.close()
        worker = _Worker(process, parent)
        # Its setup (the vocabulary's tables) is not part of any compile's budget.
        try:
            ready = parent.poll(WORKER_START_TIMEOUT_S) and parent.recv()[0] == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            worker.kill()
            raise CompileError("the compile worker did not start")
        return worker


def _fork_server() -> Any:
    """The ``forkserver`` context, its server started (idempotent): the server imports this
    module, and with it xgrammar and torch, once (seconds); each worker is then a fork of it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    multiprocessing.forkserver.ensure_running()
    return context
