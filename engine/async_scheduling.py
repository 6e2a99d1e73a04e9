"""The engine loop of asynchronous scheduling (``--async-scheduling``, vLLM's flag).

Each :meth:`AsyncStepLoop.step` schedules and launches step N+1 *before* it reads step N's
sampled ids: on a GPU the host builds N+1's inputs while the device runs N, and the only
synchronisation left is the read of N's ids, which now overlaps N+1's kernels. Step N+1's
decodes take their input token from N's ids on the device (the runner's placeholders); the
scheduler's half (:mod:`engine.async_scheduler`) advances the counts at launch. On a CPU the
model call is synchronous, so nothing overlaps, but the order and the bookkeeping are the
same code a GPU runs: that is what the CPU tests prove.

What is guaranteed: greedy and seeded tokens equal the synchronous engine's (seeded draws are
keyed by the request's seed and the token's position, never by the batch). Unseeded random
draws come from one shared generator and differ, as they do between any two batchings.

Steps that need step N's tokens on the host before N+1 is scheduled run synchronously (the
step in flight is read first): a request with structured outputs (N+1's grammar mask follows
N's token), with repetition/frequency/presence penalties (they count N's token), and any step
while speculative decoding is enabled (the proposer reads N's tokens). Stop strings need no
fallback: a stop learned when N's text is detokenized finishes the request then, and its row
in N+1 is discarded, exactly as for EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.async_scheduler import AsyncScheduler

if TYPE_CHECKING:
    from collections.abc import Sequence

    from engine.completions import Parent
    from engine.llm_engine import LLMEngine
    from engine.outputs import TokenLogprob
    from engine.request import Request
    from engine.sampler import SampledOnDevice
    from engine.scheduler import SchedulerOutput


@dataclass
class _Launched:
    """A step launched and not read yet: its plan, its sampling rows and their ids."""

    out: SchedulerOutput
    rows: list[Request]
    sampled: SampledOnDevice | None  # None: no row samples (prefill chunks only)
    row_of: dict[str, int]  # request id -> its row in ``sampled``


@dataclass(slots=True)
class _AheadRow:
    """What the sampler reads of a request whose previous token is still in flight: its
    output *length* counts the placeholders (seeded draws and ``min_tokens`` go by position;
    the penalties, which read the tokens themselves, run synchronously:
    :func:`needs_host_tokens`)."""

    sampling_params: object
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class AsyncStepLoop:
    """Runs an :class:`LLMEngine`'s steps one launch ahead of their reads.

    At most one step is in flight between calls. ``LLMEngine.step`` calls :meth:`step`
    first; when it returns False the step in flight (if any) was read and the engine runs a
    synchronous step. Not thread-safe: the engine's thread only.
    """

    def __init__(self, engine: LLMEngine) -> None:
        if not isinstance(engine.scheduler, AsyncScheduler):
            raise TypeError("asynchronous scheduling needs the engine's AsyncScheduler")
        self.engine = engine
        self.scheduler: AsyncScheduler = engine.scheduler
        self.in_flight: _Launched | None = None
        self.num_async_steps = 0
        self.num_sync_steps = 0  # steps that fell back (each reads the step in flight first)
        self.num_discarded_rows = 0  # rows of requests that finished while they were in flight

    def sync_reason(self) -> str | None:
        """Why the next step must run synchronously, or None."""
        engine = self.engine
        spec = engine.speculation
        if spec is not None and spec.is_enabled(len(self.scheduler.running)):
            return "speculative decoding"
        if self.scheduler.host_bound:
            return "structured outputs or penalties"
        return None

    def step(self, touched: list[Parent]) -> bool:
        """Launch the next step, then read the one in flight (its outputs go to ``touched``).
        False: this step must run synchronously; the step in flight has been read."""
        prev, self.in_flight = self.in_flight, None
        if self.sync_reason() is not None:
            if prev is not None:
                self._read(prev, touched)
            self.num_sync_steps += 1
            return False
        self.in_flight = self._launch(prev)
        if prev is not None:
            self._read(prev, touched)
        return True

    def _launch(self, prev: _Launched | None) -> _Launched | None:
        """Schedule and run the next step; its ids stay on the device."""
        engine = self.engine
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        engine._counters["num_steps"] += 1
        self.num_async_steps += 1
        if out.swap_out or out.swap_in:
            engine.runner.swap(out.swap_out, out.swap_in)
        engine._mark_scheduled(out)
        ids = prev.sampled.token_ids if prev is not None and prev.sampled is not None else None
        rows, logits = engine.runner.execute(out, ids, prev.row_of if prev else None)
        sampled = None
        if rows:
            sampled = engine.sampler.sample_on_device(logits, _ahead_rows(rows))
        self.scheduler.mark_launched(out)
        return _Launched(out, rows, sampled, {r.request_id: i for i, r in enumerate(rows)})

    def _read(self, launched: _Launched, touched: list[Parent]) -> None:
        """Read a launched step's ids and apply them (rows of finished requests discarded)."""
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        if launched.sampled is not None:
            result = launched.sampled.read()
            tokens, logprobs = result.token_ids, list(result.logprobs)
        keep = [i for i, r in enumerate(launched.rows) if not r.is_finished]
        rows = [launched.rows[i] for i in keep]
        self.num_discarded_rows += len(launched.rows) - len(keep)
        sampled = {launched.rows[i].request_id: tokens[i] for i in keep}
        num_outputs = [r.num_output_tokens for r in rows]
        finished = self.scheduler.update_from_launched(launched.out, sampled)
        self.engine._apply_tokens(
            launched.out,
            rows,
            num_outputs,
            [[logprobs[i]] for i in keep],
            {r.request_id for r in finished},
            sampled,
            touched,
        )


def _ahead_rows(rows: Sequence[Request]) -> list[Request | _AheadRow]:
    """The sampler's view of each row: a request with placeholders shows its output length
    with them counted (their values are never read: see :func:`needs_host_tokens`)."""
    return [
        r
        if not r.num_output_placeholders
        else _AheadRow(
            r.sampling_params,
            r.prompt_token_ids,
            [*r.output_token_ids, *[-1] * r.num_output_placeholders],
        )
        for r in rows
    ]
