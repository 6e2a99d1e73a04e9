"""The scheduler's half of asynchronous scheduling (``--async-scheduling``).

vLLM v1's order: when step N is launched, each scheduled request's ``num_computed_tokens``
advances by its scheduled tokens, and a request whose chunk reaches its end holds a
*placeholder* for the token N samples (``Request.num_output_placeholders``). Step N+1 is then
scheduled from those counts (a decode's input token is the placeholder, which the runner
resolves from N's sampled ids on the device) before N's ids are read; reading them replaces
each placeholder with its token and checks the stops. Stops are therefore learned one step
late: a request that N finishes was already scheduled into N+1, whose row for it is discarded.
``max_tokens`` and the context limit are known in advance, so no request is scheduled past
them (:meth:`Scheduler._ends_in_flight`). The synchronous :class:`Scheduler` never holds a
placeholder and behaves exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput


def needs_host_tokens(req: Request) -> bool:
    """Does choosing ``req``'s next token need its previous token on the host? Its grammar's
    mask follows that token; the penalties count it (seeded draws and ``min_tokens`` need
    only its position, which a placeholder gives)."""
    p = req.sampling_params
    return (
        req.grammar is not None
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


class AsyncScheduler(Scheduler):
    """A :class:`Scheduler` whose steps are launched before the previous step's ids are read.

    The engine calls :meth:`schedule`, runs the step (the runner reads the counts), then
    :meth:`mark_launched`; later :meth:`update_from_launched` with that step's ids, in launch
    order. Speculative guesses are never scheduled here (the engine runs those steps
    synchronously). ``host_bound`` holds the ids of the queued or running requests that
    :func:`needs_host_tokens` (the engine runs steps synchronously while there are any). Not
    thread-safe.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host_bound: set[str] = set()

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if needs_host_tokens(request):
            self.host_bound.add(request.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        super()._finish(req, status)
        self.host_bound.discard(req.request_id)

    def mark_launched(self, out: SchedulerOutput) -> None:
        """Step ``out`` was launched (the runner has read its inputs): advance counts now."""
        if out.spec_token_ids:
            raise ValueError("asynchronous scheduling does not verify speculative guesses")
        for req, num_new in out.scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # its chunk reached the end: it samples
            # Hashed now, as the synchronous engine hashes them before it schedules the next
            # step: a hit in a later step reads KV this step writes first (the device runs
            # steps in order). Only known tokens: a placeholder has no value to hash yet.
            self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))

    def update_from_launched(
        self, out: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[Request]:
        """Apply launched step ``out``'s ids (one per sampling request); return the requests
        that finished.

        A request finished since (a stop learned one step late, an abort) is skipped: its row
        is discarded. A request preempted since ``out`` was launched still takes its token
        (its KV was computed before its blocks could be reused: the device runs steps in
        order). Full blocks were hashed at launch (:meth:`mark_launched`).
        """
        finished: list[Request] = []
        for req, _ in out.scheduled:
            if req.is_finished:
                continue
            token = sampled.get(req.request_id)
            if token is None:  # a partial prefill chunk
                continue
            req.num_output_placeholders -= 1
            req.append_output_token(token)
            status = self._stop_status(req, token)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished
