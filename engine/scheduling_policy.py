"""Which waiting request runs next, and whom to preempt: fcfs, priority, or tenant-fair.

The scheduler keeps the mechanism (budget, blocks, preemption); a policy keeps the waiting
requests and the order. Waiting requests live in *flows*, one per (priority class, tenant),
each a heap in the policy's order; a pick compares the flows' heads, so it costs
O(log n + number of flows), never a scan of every waiting request.

- ``fcfs``: arrival order; the vLLM ``priority`` field and the class are ignored.
- ``priority``: ``interactive`` before ``batch``, then vLLM's ``priority`` (lower first), then
  arrival.
- ``fair``: Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models",
  OSDI 2024), i.e. weighted fair queueing over tokens. Each tenant has a counter of the
  prefill + decode tokens scheduled for it divided by its weight; the next request is the
  head of the backlogged tenant with the least counter, ``interactive`` flows before ``batch``
  ones, and within a flow by (``priority``, arrival). A tenant whose queue was empty is lifted
  to the least counter of the backlogged tenants when a request arrives, so idling banks no
  credit. A request that has waited ``max_wait_s`` (by the injected clock) goes first,
  whatever its class or counter: no starvation. With one tenant this is fcfs (by priority).
  Running slots are shared too (:mod:`engine.slot_share`): a waiting tenant below its share
  and served no more takes a slot back from the most served tenant above its own.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from engine.request import Request
from engine.slot_share import count_by_tenant, slot_shares
from engine.tenancy import TenantTag

OrderKey = tuple[int, int, float, int]  # (class rank, priority, arrival, seq): lower runs first
FlowId = tuple[int, str]  # (class rank, tenant)


@dataclass
class _Flow:
    """One tenant's waiting requests of one class; stale heap entries are skipped lazily."""

    tenant: str
    heap: list[tuple[OrderKey, int, Request]] = field(default_factory=list)  # (key, ticket, req)
    num_live: int = 0


class SchedulingPolicy:
    """The waiting queue of a :class:`~engine.scheduler.Scheduler`, in the policy's order.

    Protocol per step: :meth:`peek` the next request; the scheduler then :meth:`pop`\\ s it
    (admitted), or :meth:`hold`\\ s it (cannot run this step; the next peek skips it), or
    :meth:`hold_tenant` (the tenant is at its KV share: none of its requests this step), or
    stops. :meth:`release_holds` ends the step. :meth:`charge` is told the tokens scheduled for
    each request as they are scheduled (negative when a preemption takes them back).
    Not thread-safe.
    """

    name = "fcfs"

    def __init__(self, clock: Callable[[], float], max_wait_s: float | None = None) -> None:
        self.clock = clock
        self.max_wait_s = max_wait_s
        self._flows: dict[tuple[int, str], _Flow] = {}
        self._waiting: dict[str, tuple[int, Request]] = {}  # request id -> (ticket, request)
        self._keys: dict[str, OrderKey] = {}  # fixed at add; also orders the running list
        self._wait_since: dict[str, float] = {}
        # (wait since, key, ticket, request): overdue requests go oldest first, ties in order
        self._by_age: list[tuple[float, OrderKey, int, Request]] = []
        self._held: list[Request] = []
        self._held_tenants: set[str] = set()
        self._held_classes: set[int] = set()
        self.num_waiting_by_tenant: dict[str, int] = {}
        self._seq = 0
        self._ticket = 0

    # -- order -------------------------------------------------------------------------------

    def order_key(self, request: Request, seq: int) -> OrderKey:
        """Fixed for the request's life; the running list is sorted by it (newest last)."""
        return (0, 0, request.arrival_time, seq)

    def flow_key(self, flow: _Flow, head: OrderKey) -> tuple[float | int, ...]:
        """Which flow's head runs next: the least key."""
        return head

    def key_of(self, request: Request) -> OrderKey:
        return self._keys[request.request_id]

    # -- the queue ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """A new request, or a preempted one (it keeps its key: ahead of later arrivals)."""
        rid = request.request_id
        if rid not in self._keys:
            self._seq += 1
            self._keys[rid] = self.order_key(request, self._seq)
        self._enqueue(request, self.clock(), notify=True)

    def _enqueue(self, request: Request, wait_since: float, *, notify: bool) -> None:
        tenant = request.tenant.name
        if notify and not self.num_waiting_by_tenant.get(tenant):
            self.on_backlogged(request.tenant)
        self._ticket += 1
        rid = request.request_id
        self._waiting[rid] = (self._ticket, request)
        self._wait_since[rid] = wait_since
        flow_id = (request.tenant.class_rank, tenant)
        flow = self._flows.get(flow_id)
        if flow is None:
            flow = self._flows[flow_id] = _Flow(tenant)
        heapq.heappush(flow.heap, (self._keys[rid], self._ticket, request))
        flow.num_live += 1
        self.num_waiting_by_tenant[tenant] = self.num_waiting_by_tenant.get(tenant, 0) + 1
        if self.max_wait_s is not None:
            heapq.heappush(self._by_age, (wait_since, self._keys[rid], self._ticket, request))

    def on_backlogged(self, tenant: TenantTag) -> None:
        """A tenant with no waiting request gets one (fair lifts its counter here)."""

    def _is_live(self, ticket: int, request: Request) -> bool:
        entry = self._waiting.get(request.request_id)
        return entry is not None and entry[0] == ticket

    def peek(self) -> Request | None:
        """The request to run next (None: nothing runnable is waiting). Does not remove it."""
        aged = self._oldest_overdue()
        if aged is not None:
            return aged
        best: tuple[float | int, ...] | None = None
        best_request: Request | None = None
        for (class_rank, tenant), flow in self._flows.items():
            if tenant in self._held_tenants or class_rank in self._held_classes:
                continue
            head = self._head(flow)
            key = self.flow_key(flow, head[0])
            if best is None or key < best:
                best, best_request = key, head[2]
        return best_request

    def _head(self, flow: _Flow) -> tuple[OrderKey, int, Request]:
        heap = flow.heap
        while not self._is_live(heap[0][1], heap[0][2]):
            heapq.heappop(heap)  # stale: popped, held or aborted since it was pushed
        return heap[0]

    def _oldest_overdue(self) -> Request | None:
        if self.max_wait_s is None:
            return None
        by_age = self._by_age
        while by_age and not self._is_live(by_age[0][2], by_age[0][3]):
            heapq.heappop(by_age)
        if not by_age or self.clock() - by_age[0][0] < self.max_wait_s:
            return None
        request = by_age[0][3]
        if request.tenant.name in self._held_tenants:
            return None
        return None if request.tenant.class_rank in self._held_classes else request

    def pop(self, request: Request) -> None:
        """Take a waiting request out (admitted, or finished while waiting). O(1): lazy."""
        self._remove(request, notify=True)

    def _remove(self, request: Request, *, notify: bool) -> None:
        rid = request.request_id
        if self._waiting.pop(rid, None) is None:
            return
        del self._wait_since[rid]
        tenant = request.tenant.name
        flow_id = (request.tenant.class_rank, tenant)
        flow = self._flows[flow_id]
        flow.num_live -= 1
        if not flow.num_live:
            del self._flows[flow_id]
        left = self.num_waiting_by_tenant[tenant] - 1
        if left:
            self.num_waiting_by_tenant[tenant] = left
        else:
            del self.num_waiting_by_tenant[tenant]
            if notify:
                self.on_drained(request.tenant)

    def on_drained(self, tenant: TenantTag) -> None:
        """The tenant's last waiting request left the queue."""

    def forget(self, request: Request) -> None:
        """The request finished: drop it (waiting or not) and its key."""
        self.pop(request)
        self._keys.pop(request.request_id, None)

    def hold(self, request: Request) -> None:
        """Skip ``request`` until :meth:`release_holds` (its place in line is kept)."""
        wait_since = self._wait_since[request.request_id]
        self._remove(request, notify=False)  # a hold is no arrival: no lift on release
        self._held.append(request)
        self._wait_since[request.request_id] = wait_since

    def hold_tenant(self, tenant: str) -> None:
        """Skip every request of ``tenant`` until :meth:`release_holds`."""
        self._held_tenants.add(tenant)

    def hold_class(self, class_rank: int) -> None:
        """Skip every request of that priority class until :meth:`release_holds`."""
        self._held_classes.add(class_rank)

    def release_holds(self) -> None:
        for request in self._held:
            self._enqueue(request, self._wait_since[request.request_id], notify=False)
        self._held.clear()
        self._held_tenants.clear()
        self._held_classes.clear()

    def __len__(self) -> int:
        return len(self._waiting) + len(self._held)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in no particular order."""
        for _, request in self._waiting.values():
            yield request
        yield from self._held

    # -- accounting and preemption -----------------------------------------------------------

    def charge(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` were scheduled for ``request`` (negative: taken back)."""

    def choose_victim(
        self, running: Sequence[Request], over_kv_share: Callable[[TenantTag], bool]
    ) -> Request:
        """Whom to preempt when a running request needs blocks: the last in order."""
        return running[-1]

    def step_budget(self, budget: int, num_decodes: int, running: Sequence[Request]) -> int:
        """This step's token budget (``--max-num-batched-tokens``); fair shrinks it while
        tenants contend. ``num_decodes`` of the running requests decode this step."""
        return budget

    def prefill_reserve(
        self, request: Request, later_prefills: Sequence[Request], *, can_admit: bool
    ) -> int:
        """Tokens of this step to leave free, before ``request``'s next prefill chunk, for
        requests the policy serves first: ``later_prefills`` (running prefills after it in
        running order) and, if ``can_admit`` (a running slot is free), waiting ones. fcfs and
        priority: none (running requests go first)."""
        return 0

    def short_step(self, running: Sequence[Request], *, can_admit: bool) -> set[FlowId] | None:
        """The flows (class rank, tenant) whose prefills alone run this step, every other
        prefill sitting it out; None: no such step. fcfs and priority: never."""
        return None

    def batch_prefill_budget(self, running: Sequence[Request]) -> int | None:
        """The most prefill tokens ``batch``-class requests may take this step; None: no
        limit. fcfs and priority: none."""
        return None

    def slot_shares(self, running: Sequence[Request], max_num_seqs: int) -> dict[str, int]:
        """The running slots each active tenant is owed now; fcfs and priority: none."""
        return {}

    def can_reclaim(self, running: Sequence[Request], max_num_seqs: int) -> bool:
        """May a waiting request take a running slot back? fcfs and priority: never."""
        return False

    def reclaim_victim(
        self,
        request: Request,
        running: Sequence[Request],
        max_num_seqs: int,
        protected: Collection[str] = (),
    ) -> Request | None:
        """The running request (not in ``protected``) to preempt so that waiting ``request``
        may start (no free slot, or blocks), or None. fcfs and priority: None."""
        return None

    def on_reclaimed(self, request: Request) -> None:
        """``request`` was preempted because :meth:`reclaim_victim` named it."""


class PriorityPolicy(SchedulingPolicy):
    """``interactive`` before ``batch``, then vLLM's ``priority`` (lower first), then arrival."""

    name = "priority"

    def order_key(self, request: Request, seq: int) -> OrderKey:
        return (request.tenant.class_rank, request.priority, request.arrival_time, seq)


class FairPolicy(PriorityPolicy):
    """Virtual token counters per tenant, weighted by plan; see the module docstring.

    ``counters[t]`` is tokens scheduled for ``t`` divided by the weight of the request they
    were scheduled for. Only their differences matter; they never decrease.
    """

    name = "fair"

    def __init__(
        self,
        clock: Callable[[], float],
        max_wait_s: float | None = None,
        *,
        contended_prefill_tokens: int = 0,
        contention_window_s: float = 0.0,
        short_prefill_tokens: int = 0,
        batch_prefill_tokens: int = 0,
        batch_window_s: float = 0.0,
    ) -> None:
        super().__init__(clock, max_wait_s)
        self.counters: dict[str, float] = {}
        self._last_drained: str | None = None  # the tenant whose queue emptied last
        self.contended_prefill_tokens = contended_prefill_tokens
        self.contention_window_s = contention_window_s
        self.short_prefill_tokens = short_prefill_tokens
        self.batch_prefill_tokens = batch_prefill_tokens
        self.batch_window_s = batch_window_s
        # tenant -> the last time (clock) it had a request running or waiting (step cap)
        self._last_work: dict[str, float] = {}
        self._interactive_until = -math.inf
        # request id -> its output length when a reclaim preempted it (no thrash: see below)
        self._reclaimed_at: dict[str, int] = {}

    def step_budget(self, budget: int, num_decodes: int, running: Sequence[Request]) -> int:
        """While two or more tenants have each had work (a request running or waiting)
        within the last ``contention_window_s``, a step carries at most
        ``contended_prefill_tokens`` prefill tokens besides its decodes. Why: a step cannot be
        interrupted, so a request of a tenant that arrives mid-step waits for the rest of it,
        however fair the next pick is; on a CPU a step's time grows with its tokens. Short
        steps bound that wait. Each tenant is remembered for the window on its own, not only
        while two have work at once: a tenant that comes back after a pause (an interactive
        user's next turn, minutes later) finds short steps, not one full step of another
        tenant's prefill in flight (issue 43: that step was most of the first request's
        wait). One tenant alone gets the whole budget back once the others' windows have
        passed, and an engine only one tenant ever uses is never capped."""
        if not self.contended_prefill_tokens or not self._contended(running):
            return budget
        return min(budget, num_decodes + self.contended_prefill_tokens)

    def _contended(self, running: Sequence[Request]) -> bool:
        """Have two or more tenants had work within ``contention_window_s``? Stamps the
        tenants with work now and forgets those whose window has passed (O(running))."""
        now = self.clock()
        last = self._last_work
        for tenant in self.num_waiting_by_tenant:
            last[tenant] = now
        for r in running:
            last[r.tenant.name] = now
        if len(last) > 1:
            horizon = now - self.contention_window_s
            for tenant in [t for t, seen in last.items() if seen < horizon]:
                del last[tenant]
        return len(last) > 1

    def batch_prefill_budget(self, running: Sequence[Request]) -> int | None:
        """While an ``interactive`` request has been running or waiting within the last
        ``batch_window_s``, ``batch`` requests take at most ``batch_prefill_tokens``
        prefill tokens a step (0: no limit). Why: the class order already admits interactive
        requests first, but the step in flight when one arrives cannot be cut short, and
        batch lines' prompts filling it make the interactive request wait it out. Keeping
        the batch's share of a step small while interactive traffic is around runs the batch
        in the gaps; alone, it gets the whole budget back once the window has passed."""
        if not self.batch_prefill_tokens:
            return None
        now = self.clock()
        if any(rank == 0 for rank, _ in self._flows) or any(
            r.tenant.class_rank == 0 for r in running
        ):
            self._interactive_until = now + self.batch_window_s
        return self.batch_prefill_tokens if now <= self._interactive_until else None

    def flow_key(self, flow: _Flow, head: OrderKey) -> tuple[float | int, ...]:
        return (head[0], self.counters.get(flow.tenant, 0.0), *head[1:])

    def on_backlogged(self, tenant: TenantTag) -> None:
        # VTC's lift: no credit for the time it sent nothing, so it cannot burst past others.
        others = [self.counters.get(t, 0.0) for t in self.num_waiting_by_tenant]
        if others:
            floor = min(others)
        else:  # nobody waits: start level with the tenant that was served last
            floor = self.counters.get(self._last_drained, 0.0) if self._last_drained else 0.0
        self.counters[tenant.name] = max(self.counters.get(tenant.name, 0.0), floor)

    def on_drained(self, tenant: TenantTag) -> None:
        self._last_drained = tenant.name

    def charge(self, request: Request, num_tokens: int) -> None:
        name = request.tenant.name
        self.counters[name] = self.counters.get(name, 0.0) + num_tokens / request.tenant.weight

    def choose_victim(
        self, running: Sequence[Request], over_kv_share: Callable[[TenantTag], bool]
    ) -> Request:
        """A tenant over its KV share first, then batch before interactive, then the most
        served tenant (highest counter); its newest request (last in order)."""
        counters = self.counters

        def victim_key(r: Request) -> tuple[bool, int, float, OrderKey]:
            key = self.key_of(r)
            return (over_kv_share(r.tenant), key[0], counters.get(r.tenant.name, 0.0), key)

        return max(running, key=victim_key)

    def prefill_reserve(
        self, request: Request, later_prefills: Sequence[Request], *, can_admit: bool
    ) -> int:
        """The prompt tokens still to compute of every request of another tenant served no
        more (lower class rank, or the same class and a counter no higher: a tenant lifted on
        arrival ties with the one it was lifted to, and the newcomer should not lose the tie
        to a prefill already under way) that would otherwise wait behind ``request``'s chunk:
        each later running prefill and, if one can be admitted, each waiting flow's head.
        Without it an older tenant's long running prefill takes the whole budget step after
        step and a newly arrived tenant gets the leftovers (a 16-token prompt spread over
        several steps). One tenant: always 0, so fair plans what fcfs plans."""
        tenant = request.tenant.name
        rank = self._rank(request.tenant.class_rank, tenant)
        need = 0
        for (class_rank, other), flow in self._flows.items() if can_admit else ():
            if other != tenant and other not in self._held_tenants:
                if self._rank(class_rank, other) <= rank:
                    head = self._head(flow)[2]
                    need += head.num_tokens - head.num_computed_tokens
        for r in later_prefills:
            if r.tenant.name != tenant and self._rank(r.tenant.class_rank, r.tenant.name) <= rank:
                need += r.num_tokens - r.num_computed_tokens
        return need

    def short_step(self, running: Sequence[Request], *, can_admit: bool) -> set[FlowId] | None:
        """The least-served flows (by class, then counter; on a tie the one needing fewer
        tokens first) whose prompt tokens still to compute, running or waiting (if
        ``can_admit``), come to at most ``short_prefill_tokens`` in all, when some other flow
        has prefill work too: this step is theirs and the decodes'. Every other prefill sits
        it out (a running one keeps one token, so it never stalls) and no other waiting
        request is admitted in it. Why: on a CPU a step's time grows with its tokens, so a
        newcomer's 16-token prompt sharing a step with another tenant's 250-token chunk waits
        for all of it, and alone with the decodes its step is a fraction of that. The flows
        served more pay one step's fixed cost per such prompt; their counters decide how often
        (a tenant that keeps sending short prompts soon outranks them and loses the favour).
        A tenant lifted on arrival ties with the one it was lifted to; the smaller need wins
        the tie, so a newcomer's short prompt is not queued behind a long one. No short step
        while a request is overdue (``max_wait_s``): the wait bound comes first."""
        if not self.short_prefill_tokens or self._oldest_overdue() is not None:
            return None
        need: dict[FlowId, int] = {}
        for r in running:
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                flow_id = (r.tenant.class_rank, r.tenant.name)
                need[flow_id] = need.get(flow_id, 0) + left
        if can_admit:
            for flow_id, flow in self._flows.items():
                if flow_id[1] not in self._held_tenants:
                    head = self._head(flow)[2]
                    left = head.num_tokens - head.num_computed_tokens
                    need[flow_id] = need.get(flow_id, 0) + left
        if len(need) < 2:
            return None
        order = sorted(need, key=lambda f: (self._rank(*f), need[f]))
        favoured: set[FlowId] = set()
        total = 0
        for flow_id in order:
            total += need[flow_id]
            if total > self.short_prefill_tokens:
                break
            favoured.add(flow_id)
        # None as well when every flow's work is short: nobody needs to sit out
        return favoured if favoured and len(favoured) < len(order) else None

    def _rank(self, class_rank: int, tenant: str) -> tuple[int, float]:
        return (class_rank, self.counters.get(tenant, 0.0))

    # -- slot share ----------------------------------------------------------------------------

    def slot_shares(self, running: Sequence[Request], max_num_seqs: int) -> dict[str, int]:
        """The running slots each active tenant (running or waiting) is owed
        (:func:`engine.slot_share.slot_shares`)."""
        tags: dict[str, TenantTag] = {r.tenant.name: r.tenant for r in running}
        for flow in self._flows.values():
            tags.setdefault(flow.tenant, self._head(flow)[2].tenant)
        return slot_shares(tags.values(), max_num_seqs)

    def can_reclaim(self, running: Sequence[Request], max_num_seqs: int) -> bool:
        """Does a waiting tenant hold fewer slots than its share while another holds more?"""
        if not self._flows or not running:
            return False
        shares = self.slot_shares(running, max_num_seqs)
        held = count_by_tenant(running)
        if not any(held[t] > shares[t] for t in held):
            return False
        return any(
            held.get(flow.tenant, 0) < shares[flow.tenant]
            for flow in self._flows.values()
            if flow.tenant not in self._held_tenants
        )

    def reclaim_victim(
        self,
        request: Request,
        running: Sequence[Request],
        max_num_seqs: int,
        protected: Collection[str] = (),
    ) -> Request | None:
        """Slot share: ``request``'s tenant holds fewer running slots than its share
        (:meth:`slot_shares`), so it takes one back from the most served tenant (batch
        before interactive, then the highest counter) among those that hold more than their
        share and are served no less than it (class, then counter): that tenant's newest
        running request that has made progress since a reclaim last preempted it, i.e.
        produced a token since (no thrash: a request is not preempted for a share twice
        before it advances). None when no tenant qualifies: the request waits for a slot as
        before. A move goes from a tenant above its share to one below it, so it never moves
        back (neither side crosses its share), and a batch request never takes an
        interactive one's slot."""
        name = request.tenant.name
        shares = self.slot_shares(running, max_num_seqs)
        held = count_by_tenant(running)
        if held.get(name, 0) >= shares.get(name, 1):
            return None
        mine = self._rank(request.tenant.class_rank, name)
        best: Request | None = None
        best_key: tuple[float | int, ...] = ()
        for r in running:
            tenant = r.tenant.name
            if tenant == name or held[tenant] <= shares[tenant] or r.request_id in protected:
                continue
            rank = self._rank(r.tenant.class_rank, tenant)
            if rank < mine or self._reclaimed_at.get(r.request_id, -1) >= r.num_output_tokens:
                continue
            key = (*rank, *self.key_of(r))
            if best is None or key > best_key:
                best, best_key = r, key
        return best

    def on_reclaimed(self, request: Request) -> None:
        self._reclaimed_at[request.request_id] = request.num_output_tokens

    def forget(self, request: Request) -> None:
        super().forget(request)
        self._reclaimed_at.pop(request.request_id, None)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}


def make_policy(
    name: str,
    clock: Callable[[], float],
    max_wait_s: float = math.inf,
    *,
    contended_prefill_tokens: int = 0,
    contention_window_s: float = 0.0,
    short_prefill_tokens: int = 0,
    batch_prefill_tokens: int = 0,
    batch_window_s: float = 0.0,
) -> SchedulingPolicy:
    """The policy ``--scheduling-policy`` names. Under fair, ``max_wait_s`` bounds waiting,
    ``contended_prefill_tokens`` (0: off) caps a step's prefill while tenants contend, and
    a less-served tenant's prompt of at most ``short_prefill_tokens`` runs in a step without
    the others' prefill chunks (0: off), and ``batch`` requests take at most
    ``batch_prefill_tokens`` of a step while interactive ones have been around within
    ``batch_window_s`` (0: off)."""
    if name not in POLICIES:
        raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}; got {name!r}")
    if name != "fair":
        return POLICIES[name](clock, None)
    wait = max_wait_s if math.isfinite(max_wait_s) else None
    return FairPolicy(
        clock,
        wait,
        contended_prefill_tokens=contended_prefill_tokens,
        contention_window_s=contention_window_s,
        short_prefill_tokens=short_prefill_tokens,
        batch_prefill_tokens=batch_prefill_tokens,
        batch_window_s=batch_window_s,
    )
