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
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from engine.request import Request
from engine.tenancy import TenantTag

OrderKey = tuple[int, int, float, int]  # (class rank, priority, arrival, seq): lower runs first


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
        for (_, tenant), flow in self._flows.items():
            if tenant in self._held_tenants:
                continue
            heap = flow.heap
            while not self._is_live(heap[0][1], heap[0][2]):
                heapq.heappop(heap)  # stale: popped, held or aborted since it was pushed
            key = self.flow_key(flow, heap[0][0])
            if best is None or key < best:
                best, best_request = key, heap[0][2]
        return best_request

    def _oldest_overdue(self) -> Request | None:
        if self.max_wait_s is None:
            return None
        by_age = self._by_age
        while by_age and not self._is_live(by_age[0][2], by_age[0][3]):
            heapq.heappop(by_age)
        if not by_age or self.clock() - by_age[0][0] < self.max_wait_s:
            return None
        request = by_age[0][3]
        return None if request.tenant.name in self._held_tenants else request

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

    def release_holds(self) -> None:
        for request in self._held:
            self._enqueue(request, self._wait_since[request.request_id], notify=False)
        self._held.clear()
        self._held_tenants.clear()

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

    def __init__(self, clock: Callable[[], float], max_wait_s: float | None = None) -> None:
        super().__init__(clock, max_wait_s)
        self.counters: dict[str, float] = {}
        self._last_drained: str | None = None  # the tenant whose queue emptied last

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


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}


def make_policy(
    name: str, clock: Callable[[], float], max_wait_s: float = math.inf
) -> SchedulingPolicy:
    """The policy ``--scheduling-policy`` names; ``max_wait_s`` bounds waiting under fair."""
    if name not in POLICIES:
        raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}; got {name!r}")
    wait = max_wait_s if name == "fair" and math.isfinite(max_wait_s) else None
    return POLICIES[name](clock, wait)
