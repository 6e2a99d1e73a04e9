"""Which requests run this step, and how many tokens each: one token-budget loop."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import ParameterError
from engine.scheduling_policy import SchedulingPolicy, make_policy
from engine.stats import TenantStats
from engine.tenancy import TenantTag


@dataclass
class SchedulerOutput:
    """One step's plan, carried out by the model runner.

    ``scheduled`` lists (request, num_new_tokens), decodes first, then prefill chunks; a
    request's new tokens are ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``.
    The runner copies ``swap_out`` pairs, then ``swap_in`` pairs, before the forward pass.
    ``block_tables`` values are the requests' live ``block_ids`` lists: read, never mutate.
    ``spec_token_ids`` holds the guesses (speculative decoding) to verify for a decoding
    request: they are the LAST ``len(guesses)`` of its ``num_new_tokens``, fed after its
    real tokens, and the runner returns logits for its last real token and every guess.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    num_preempted: int = 0
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

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
    tenants: tuple[TenantStats, ...] = ()


@dataclass
class _Step:
    """The plan being built: token budget left, and (request, tokens, is decode) by id."""

    budget: int
    planned: dict[str, tuple[Request, int, bool]] = field(default_factory=dict)
    # (class rank, tenant) flows whose prefills alone run (the policy's short step), or None
    favoured: set[tuple[int, str]] | None = None
    # prefill tokens batch-class requests may still take this step (None: no limit)
    batch_left: int | None = None
    num_reclaimed: int = 0  # preemptions for a slot share (admission goes on after them)
    admitted: set[str] = field(default_factory=set)  # ids admitted in this step

    def sits_out(self, req: Request) -> bool:
        """Is ``req``'s prefill kept out of this step (another flow's short step)?"""
        return self.favoured is not None and (
            (req.tenant.class_rank, req.tenant.name) not in self.favoured
        )

    def scheduled(self) -> list[tuple[Request, int]]:
        """Decodes first, then prefill chunks, each in planning order."""
        decodes = [(r, n) for r, n, d in self.planned.values() if d]
        return decodes + [(r, n) for r, n, d in self.planned.values() if not d]


class Scheduler:
    """Decides each step's batch within ``max_num_batched_tokens`` and ``max_num_seqs``.

    Order: running requests (in the policy's order, oldest first; decode tokens are reserved
    before prefill chunks), then waiting ones as the :mod:`scheduling policy
    <engine.scheduling_policy>` picks them (``--scheduling-policy``: fair, fcfs, priority). A
    waiting request whose tenant already holds its ``kv_share`` of the KV blocks waits while
    other tenants' requests go ahead (a tenant holding no blocks may always start one, so
    nothing livelocks). When a running request cannot get a block, the policy names a victim
    (fcfs/priority: the newest running request; fair: the most over-served tenant's newest),
    which is swapped to the CPU pool in mode "swap" (when it fits), else recomputed: its
    blocks are freed and it re-enters the waiting queue with its output kept, to be prefilled
    again as prompt + output. A request the pool could never hold is refused by
    :meth:`check_fits` before it is added, so the loop never livelocks. Token-level stops are
    decided here (see :meth:`update_from_output`); stop strings are the engine loop's, which
    calls :meth:`finish_request`. ``clock`` (monotonic seconds) times the fair policy's wait
    bound; tests inject their own. Not thread-safe.
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # The context limit: the model's, or what the whole KV pool holds if that is less, so
        # a request running alone always fits (no livelock) and max_tokens=None is bounded.
        capacity = num_gpu_blocks * config.block_size
        self.max_model_len = min(max_model_len, capacity)
        self._limit_text = (
            f"this model's maximum context length is {max_model_len} tokens"
            if max_model_len <= capacity
            else f"the KV cache holds at most {capacity} tokens per request "
            "(raise --kv-cache-memory)"
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(
            num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks if config.preemption_mode == "swap" else 0,
            hash_seed=hash_seed,
        )
        self.requests: dict[str, Request] = {}
        self.policy = make_policy(
            config.scheduling_policy,
            clock,
            config.fair_max_wait_s,
            contended_prefill_tokens=config.fair_contended_prefill_tokens,
            contention_window_s=config.fair_contention_window_s,
            short_prefill_tokens=config.fair_short_prefill_tokens,
            batch_prefill_tokens=config.fair_batch_prefill_tokens,
            batch_window_s=config.fair_batch_window_s,
        )
        # Running: sorted by the policy's order key, so the newest is last and pops in O(1).
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_reclaims = 0  # preemptions that gave a tenant its slot share back
        # tenant -> [prompt tokens, generation tokens] scheduled (cumulative; metrics)
        self.tenant_tokens: dict[str, list[int]] = {}

    @property
    def waiting(self) -> SchedulingPolicy:
        """The waiting requests (swapped-out ones included), as the policy orders them."""
        return self.policy

    # -- admission ---------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int | None) -> None:
        """Raise ParameterError (a ValueError) if such a request could never complete."""
        if prompt_len < 1:
            raise ParameterError("prompt", "prompt must contain at least one token")
        if prompt_len >= self.max_model_len:
            raise ParameterError(
                "prompt",
                f"prompt is {prompt_len} tokens; {self._limit_text}, including at least one "
                "generated token",
            )
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise ParameterError(
                "max_tokens",
                f"{self._limit_text}; you requested {prompt_len + max_tokens} tokens "
                f"({prompt_len} in the prompt, {max_tokens} in max_tokens)",
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
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.policy.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (oldest first), then waiting ones."""
        out = SchedulerOutput()
        step = _Step(self.config.max_num_batched_tokens)
        # Reserve a token for every running decode so an older prefill chunk cannot starve them.
        num_pending_decodes = sum(1 for r in self.running if _num_unscheduled(r) == 1)
        prefills = [r for r in self.running if _num_unscheduled(r) > 1]
        prefill_index = {r.request_id: i for i, r in enumerate(prefills)}
        step.budget = self.policy.step_budget(step.budget, num_pending_decodes, self.running)
        step.favoured = self.policy.short_step(self.running, can_admit=self._can_admit())
        if self.config.enable_chunked_prefill:  # whole prompts could never fit a small cap
            step.batch_left = self.policy.batch_prefill_budget(self.running)
        for req in list(self.running):  # a copy: a preemption takes requests out of running
            if step.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted this step to make room for an earlier one
            remaining = _num_unscheduled(req)
            num_spec = 0
            if remaining == 1:
                num_pending_decodes -= 1
                if req.num_output_placeholders and self._ends_in_flight(req):
                    continue  # asynchronous scheduling: its last token is already launched
                num_new = 1
                if req.spec_token_ids:
                    num_spec = self._num_guesses(req, step.budget - 1 - num_pending_decodes)
            else:
                if step.sits_out(req):
                    reserve = step.budget  # the step is other flows' (short prefills)
                else:
                    later = prefills[prefill_index[req.request_id] + 1 :]
                    reserve = self.policy.prefill_reserve(req, later, can_admit=self._can_admit())
                # at least one token for this prefill: what is reserved may find no blocks
                reserve = max(0, min(reserve, step.budget - num_pending_decodes - 1))
                num_new = min(remaining, step.budget - num_pending_decodes - reserve)
                if step.batch_left is not None and req.tenant.class_rank:
                    num_new = min(num_new, step.batch_left)
                if num_new <= 0:
                    continue
            # Guesses get slots only if they fit as they are: never preempt for a guess.
            if num_spec and self.kv.allocate_slots(req, num_new + num_spec) is not None:
                out.spec_token_ids[req.request_id] = req.spec_token_ids[:num_spec]
                num_new += num_spec
            elif not self._allocate_or_preempt(req, num_new, out, step):
                continue  # the request itself was the victim
            req.spec_token_ids = []
            self._plan(step, req, num_new, is_decode=remaining == 1)
        self._admit_waiting(out, step)
        for req, num_new, is_decode in step.planned.values():
            counts = self.tenant_tokens.get(req.tenant.name)
            if counts is None:
                counts = self.tenant_tokens[req.tenant.name] = [0, 0]
            counts[is_decode] += num_new  # [prompt, generation]: tokens as scheduled
        out.scheduled = step.scheduled()
        out.block_tables = {r.request_id: r.block_ids for r, _ in out.scheduled}
        return out

    def _admit_waiting(self, out: SchedulerOutput, step: _Step) -> None:
        """Admit waiting requests in the policy's order, unless this step preempted for blocks.

        A request whose adapter would exceed --max-loras is held (skipped this step); so is
        every request of a tenant at its KV share or its ``max_running``. With no free slot,
        or no free blocks, a request may take a slot back (the policy names whom: slot share)
        or its tenant is held. The first request that finds no blocks stops admission (it is
        not overtaken: no head-of-line starvation of large requests).
        """
        policy = self.policy
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        while out.num_preempted == step.num_reclaimed and self._can_admit():
            if step.budget <= 0 and len(self.running) < self.config.max_num_seqs:
                break  # (a full running set may still take a slot, and its tokens, back)
            req = policy.peek()
            if req is None:
                break
            lora = req.lora_request
            if lora is not None and lora.lora_int_id not in loras:
                if len(loras) >= self.config.max_loras:
                    policy.hold(req)
                    continue
            if self._at_kv_share(req) or self._at_max_running(req):
                policy.hold_tenant(req.tenant.name)
                continue
            if step.sits_out(req):  # another flow's short step
                if any(tenant == req.tenant.name for _, tenant in step.favoured or ()):
                    policy.hold(req)  # the tenant's other class is favoured: only this one
                else:
                    policy.hold_tenant(req.tenant.name)
                continue
            if step.batch_left is not None and req.tenant.class_rank and step.batch_left <= 0:
                policy.hold_class(req.tenant.class_rank)  # the batch's share of the step is spent
                continue
            if len(self.running) >= self.config.max_num_seqs and not self._reclaim(req, out, step):
                policy.hold_tenant(req.tenant.name)  # no slot for it; another tenant may get one
                continue
            budget = step.budget
            if step.batch_left is not None and req.tenant.class_rank:
                budget = min(budget, step.batch_left)
            num_new = self._start(req, budget, out) if budget > 0 else 0
            while num_new is None and self._reclaim(req, out, step):  # short of blocks
                num_new = self._start(req, budget, out)
            if not num_new:
                break
            policy.pop(req)
            if lora is not None:
                loras.add(lora.lora_int_id)
            req.status = RequestStatus.RUNNING
            step.admitted.add(req.request_id)
            bisect.insort(self.running, req, key=policy.key_of)
            self._plan(step, req, num_new, is_decode=num_new == 1)
        policy.release_holds()

    def _can_admit(self) -> bool:
        """Is there a free running slot, or may a waiting request take one back?"""
        max_num_seqs = self.config.max_num_seqs
        return len(self.running) < max_num_seqs or self.policy.can_reclaim(
            self.running, max_num_seqs
        )

    def _start(self, req: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Blocks for a waiting request's first chunk (swapped in, or after its cached
        prefix): how many tokens it runs now; 0: none this step (the budget); None: no
        blocks."""
        if req.num_output_placeholders:
            return 0  # preempted with a token in flight: it restarts once that is read
        if req.status == RequestStatus.SWAPPED:
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if not num_new:
                return 0
            pairs = self.kv.swap_in(req, num_new)
            if pairs is None:
                return None
            out.swap_in.extend(pairs)
            return num_new
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        num_new = self._chunk(req.num_tokens - num_hit_tokens, budget)
        if not num_new:
            return 0
        if self.kv.allocate_slots(req, num_new, hits) is None:
            return None
        self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
        req.num_computed_tokens = num_hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_tokens = num_hit_tokens
        return num_new

    def _reclaim(self, req: Request, out: SchedulerOutput, step: _Step) -> bool:
        """Slot share: preempt the running request the policy names so that ``req`` may
        start (its full computed blocks stay in the prefix cache); False if none."""
        # never one admitted in this step: its swap-in would be copied after its swap-out
        victim = self.policy.reclaim_victim(
            req, self.running, self.config.max_num_seqs, protected=step.admitted
        )
        if victim is None:
            return False
        self.running.remove(victim)  # O(running), on the rare preemption path
        self._unplan(step, victim)
        # Recompute, never swap: a swap-out now could take CPU blocks a swap-in admitted
        # earlier in this step has just freed, and the runner copies swap-outs first.
        self._preempt(victim, out, swap=False)
        self.policy.on_reclaimed(victim)
        step.num_reclaimed += 1
        self.num_reclaims += 1
        return True

    def _at_max_running(self, req: Request) -> bool:
        """Is ``req``'s tenant already running its plan's ``max_running`` sequences?"""
        cap = req.tenant.max_running
        if not cap:
            return False
        return sum(1 for r in self.running if r.tenant.name == req.tenant.name) >= cap

    def _at_kv_share(self, req: Request) -> bool:
        """Would admitting ``req`` take its tenant past its KV share? Never for a tenant that
        holds no blocks: each tenant may always run one request (check_fits made sure the
        pool holds one), so a small share cannot livelock. The request is counted at its full
        current length (prompt + output so far), not only this step's chunk."""
        tenant = req.tenant
        if tenant.kv_share >= 1.0:
            return False
        held = self.kv.num_tenant_blocks(tenant.name)
        if not held:
            return False
        need = self.kv.num_blocks_for_tokens(req.num_tokens)
        return held + need > tenant.kv_share * self.kv.pool.num_blocks

    def _over_kv_share(self, tenant: TenantTag) -> bool:
        return self.kv.num_tenant_blocks(tenant.name) > tenant.kv_share * self.kv.pool.num_blocks

    def _plan(self, step: _Step, req: Request, num_new: int, *, is_decode: bool) -> None:
        """Put ``req`` in this step; its tokens count for its tenant from now (so later
        picks in the same step already see them)."""
        step.planned[req.request_id] = (req, num_new, is_decode)
        step.budget -= num_new
        if step.batch_left is not None and req.tenant.class_rank and not is_decode:
            step.batch_left -= num_new
        self.policy.charge(req, num_new)

    def _unplan(self, step: _Step, req: Request) -> None:
        """Take back a request planned earlier in this step (it was preempted)."""
        entry = step.planned.pop(req.request_id, None)
        if entry is not None:
            step.budget += entry[1]
            if step.batch_left is not None and req.tenant.class_rank and not entry[2]:
                step.batch_left += entry[1]
            self.policy.charge(req, -entry[1])

    def _num_guesses(self, req: Request, budget: int) -> int:
        """How many of a decode's guesses to verify: what the budget and the context allow."""
        return max(0, min(len(req.spec_token_ids), budget, self.max_model_len - req.num_tokens))

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """How many of a prefill's ``num_tokens`` to run now (0: not this step)."""
        if num_tokens <= budget or self.config.enable_chunked_prefill:
            return min(num_tokens, budget)
        # Without chunked prefill a prefill runs whole. Only one longer than the whole budget
        # (a preempted request's prompt + output) is split, or it could never run again.
        return budget if budget == self.config.max_num_batched_tokens else 0

    def _allocate_or_preempt(
        self, req: Request, num_new: int, out: SchedulerOutput, step: _Step
    ) -> bool:
        """Slots for a running request, preempting the policy's victims until they fit.

        A victim planned earlier in this step is taken out of the plan. False if ``req``
        itself had to go.
        """
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self.policy.choose_victim(self.running, self._over_kv_share)
            if victim is self.running[-1]:
                self.running.pop()
            else:
                self.running.remove(victim)  # O(running), on the rare preemption path
            self._unplan(step, victim)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput, *, swap: bool = True) -> None:
        """Take a running request off the device: swap its KV out (mode "swap" and ``swap``),
        else drop it to recompute (its computed full blocks stay in the prefix cache)."""
        self.num_preemptions += 1
        out.num_preempted += 1
        request.num_preemptions += 1
        request.spec_token_ids = []
        out.spec_token_ids.pop(request.request_id, None)
        can_swap = swap and self.config.preemption_mode == "swap"
        pairs = self.kv.swap_out(request) if can_swap else None
        if pairs is not None:
            out.swap_out.extend(pairs)
            request.status = RequestStatus.SWAPPED
        else:  # recompute: output kept; prompt + output is prefilled again (prefix cache helps)
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
        # Back at its original place: ahead of everything that arrived after it.
        self.policy.add(request)

    def update_from_output(
        self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Apply a step's results; return the requests that finished in it.

        ``sampled`` maps request id -> token for the requests whose chunk reached their last
        token (a partial prefill chunk takes no token even if one is given). A request that
        verified guesses gets a list: the guesses the target accepted, then its own token.
        The accepted guesses' KV is kept (they count as computed and their full blocks are
        hashed); blocks that only held rejected guesses are freed. Tokens are appended one by
        one, each checked for a stop: tokens after a stop are dropped.
        """
        finished: list[Request] = []
        for req, num_new in out.scheduled:
            if req.is_finished:
                continue
            num_spec = len(out.spec_token_ids.get(req.request_id, ()))
            req.num_computed_tokens += num_new - num_spec
            sample = sampled.get(req.request_id)
            if sample is None or req.num_computed_tokens < req.num_tokens:
                self.kv.cache_blocks(req, req.num_computed_tokens)
                continue
            tokens = (sample,) if isinstance(sample, int) else sample
            for i, token in enumerate(tokens):
                if i:  # the guess fed at this position was accepted: its KV is valid
                    req.num_computed_tokens += 1
                req.append_output_token(token)
                status = self._stop_status(req, token)
                if status is not None:
                    self.kv.cache_blocks(req, req.num_computed_tokens)
                    self._finish(req, status)
                    finished.append(req)
                    break
            else:
                self.kv.cache_blocks(req, req.num_computed_tokens)
                if num_spec:
                    self.kv.free_tail(req, req.num_tokens)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _ends_in_flight(self, req: Request) -> bool:
        """Does a launched token already take ``req`` to max_tokens or the context limit?"""
        num_output = req.num_output_tokens + req.num_output_placeholders
        max_tokens = req.sampling_params.max_tokens
        return req.num_tokens + req.num_output_placeholders >= self.max_model_len or (
            max_tokens is not None and num_output >= max_tokens
        )

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        """Token-level stops (stop strings are the detokenizer's); sets ``stop_reason``."""
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and req.num_output_tokens >= params.max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End a request now (abort, or a stop string) and free its blocks. Unknown id: no-op."""
        if status <= RequestStatus.SWAPPED:
            raise ValueError(f"{status.name} is not a finished status")
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)  # O(n) on a rare path (abort / stop string)
        req.stop_reason = stop_reason
        self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req)
        del self.requests[req.request_id]
        self.policy.forget(req)

    def lora_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Adapter names of the running and of the waiting requests, sorted (metrics)."""
        running = {r.lora_request.name for r in self.running if r.lora_request}
        waiting = {r.lora_request.name for r in self.policy if r.lora_request}
        return tuple(sorted(running)), tuple(sorted(waiting))

    @property
    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        num_swapped = sum(1 for r in self.policy if r.status == RequestStatus.SWAPPED)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.policy),
            num_swapped=num_swapped,
            num_gpu_blocks=kv.num_gpu_blocks,
            num_used_gpu_blocks=kv.num_used_gpu_blocks,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            tenants=self.tenant_stats(),
        )

    def tenant_stats(self) -> tuple[TenantStats, ...]:
        """Per tenant ever scheduled or now waiting: queue sizes, KV blocks, tokens."""
        waiting = self.policy.num_waiting_by_tenant
        blocks = self.kv.tenant_blocks()
        running: dict[str, int] = {}
        for r in self.running:
            running[r.tenant.name] = running.get(r.tenant.name, 0) + 1
        shares = self.policy.slot_shares(self.running, self.config.max_num_seqs)
        names = sorted(self.tenant_tokens.keys() | waiting.keys() | blocks.keys())
        return tuple(
            TenantStats(
                name=name,
                num_waiting=waiting.get(name, 0),
                num_running=running.get(name, 0),
                num_kv_blocks=blocks.get(name, 0),
                num_slot_share=shares.get(name, 0),
                num_prompt_tokens=self.tenant_tokens.get(name, (0, 0))[0],
                num_generation_tokens=self.tenant_tokens.get(name, (0, 0))[1],
            )
            for name in names
        )


def _num_unscheduled(req: Request) -> int:
    """Tokens of ``req`` not yet scheduled: its placeholders count (asynchronous scheduling)."""
    return req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
