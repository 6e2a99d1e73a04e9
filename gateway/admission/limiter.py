"""Token buckets, concurrency slots and monthly budgets behind one small interface.

A :class:`Limiter` knows nothing about tenants or HTTP: it takes a :class:`BucketSet` (the keys
and limits a request touches, built by :mod:`gateway.admission.admission`) and the request's
costs, and answers with a :class:`Decision`. Two implementations pass the same conformance suite:

- :class:`RedisLimiter`: ``gateway/admission/limiter.lua`` evaluates every bucket in one atomic
  EVALSHA (all pass and are charged, or none is), with Redis ``TIME`` as the shared clock. This is
  what makes the limits hold exactly across any number of gateway replicas.
- :class:`LocalLimiter`: the same algorithm in process memory, used while Redis is unreachable.
  Each replica then enforces ``share`` of every limit (1 / number of replicas).

Units: rate limits are per minute (capacity = the limit, refill = limit / 60 per second), times
are integer microseconds, budgets are integers per period whose unit and period the key names
(tokens per UTC month, or micro-dollars per UTC day or month: gateway/admission/admission.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from gateway.admission.redis_pipe import RedisPipe, script_sha
from gateway.store import RedisClient

US_PER_MINUTE = 60_000_000
LUA_SOURCE = resources.files("gateway.admission").joinpath("limiter.lua").read_text()


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000


def format_duration(ms: int) -> str:
    """A duration as OpenAI (Go's time.Duration) writes it: 20ms, 1s, 1.5s, 6m0s, 1h0m0s."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0") if rest % 1000 else str(rest // 1000)
    text = f"{seconds}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return text


@dataclass(frozen=True, slots=True)
class BucketSet:
    """The buckets one request touches, in script order: rate buckets, slot sets, budgets.

    ``labels`` name each bucket in the same order (e.g. ``"tenant requests_per_minute"``) so a
    :class:`Decision`'s ``failed`` index can be turned into a message. Built once per
    (tenant, key, model) and reused: key names are never formatted on the hot path.
    """

    rate_keys: tuple[str, ...] = ()
    rate_limits: tuple[int, ...] = ()
    slot_keys: tuple[str, ...] = ()
    slot_limits: tuple[int, ...] = ()
    budget_keys: tuple[str, ...] = ()
    budget_limits: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()
    keys: tuple[str, ...] = field(init=False)
    limits: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", self.rate_keys + self.slot_keys + self.budget_keys)
        object.__setattr__(self, "limits", self.rate_limits + self.slot_limits + self.budget_limits)

    @property
    def empty(self) -> bool:
        return not self.keys


@dataclass(frozen=True, slots=True)
class Decision:
    """A limiter's answer to one admission.

    ``failed`` indexes :attr:`BucketSet.keys` (rate buckets, then slot sets, then budgets): the
    bucket that refused, ``None`` when allowed. A spent budget is reported before a full slot
    set, and that before a rate bucket. ``retry_after_ms`` is the wait until every rate bucket
    holds enough (exact: tokens accrue continuously); 0 when no rate bucket is short.
    ``remaining``/``reset_ms`` are per rate bucket, after the charge when allowed (reset: time
    until the bucket is full again).
    """

    allowed: bool
    failed: int | None
    retry_after_ms: int
    remaining: tuple[int, ...]
    reset_ms: tuple[int, ...]
    slots_in_use: tuple[int, ...]
    budget_used: tuple[int, ...]


class Limiter(Protocol):
    """The admission mechanism. Implementations are safe to share across asyncio tasks.

    Rate and slot limits must be positive (a limit of 0 is the caller's to refuse up front);
    costs and charges are non-negative integers, deltas any integers.
    """

    async def acquire(
        self,
        buckets: BucketSet,
        costs: Sequence[int],
        slot_id: str,
        lease_us: int,
        needs: Sequence[int] = (),
    ) -> Decision:
        """Charge ``costs[i]`` to rate bucket i and take a slot in every slot set, atomically.

        Budgets are checked (refused once used >= limit, or once used + ``needs[b]`` > limit:
        what the request surely costs must fit; no ``needs``: 0 each), not charged. A refused
        request changes no bucket.
        """
        ...

    async def settle(
        self,
        buckets: BucketSet,
        deltas: Sequence[int],
        charges: Sequence[int],
        slot_id: str,
    ) -> None:
        """Give rate bucket i ``-deltas[i]`` tokens back (a negative delta charges, possibly into
        debt), add ``charges[b]`` to budget b, and free ``slot_id`` in every slot set."""
        ...


class RedisLimiter:
    """Limiter backed by ``gateway/admission/limiter.lua`` on a shared Redis.

    One EVALSHA per admission and one per settle (reloaded with EVAL on NOSCRIPT). With a ``pipe``
    (:class:`~gateway.admission.redis_pipe.RedisPipe`, what the gateway uses) they go over its one
    pipelined connection; without, through redis-py's client and pool. ``clock`` exists for the
    conformance tests only: when given, its time (us) is sent to the script instead of letting the
    script read Redis ``TIME``.
    """

    def __init__(
        self,
        redis: RedisClient,
        *,
        budget_ttl_s: int = 62 * 86400,
        clock: Callable[[], int] | None = None,
        pipe: RedisPipe | None = None,
    ) -> None:
        self._script = redis.register_script(LUA_SOURCE)
        self._sha = script_sha(LUA_SOURCE)
        self._budget_ttl_s = budget_ttl_s
        self._clock = clock
        self._pipe = pipe

    async def _run(self, keys: tuple[str, ...], args: list[str | int]) -> Any:
        if self._pipe is not None:
            return await self._pipe.evalsha(self._sha, LUA_SOURCE, keys, args)
        return await self._script(keys=keys, args=args)

    def _now_arg(self) -> str | int:
        return "" if self._clock is None else self._clock()

    async def acquire(
        self,
        buckets: BucketSet,
        costs: Sequence[int],
        slot_id: str,
        lease_us: int,
        needs: Sequence[int] = (),
    ) -> Decision:
        args: list[str | int] = [
            "admit",
            self._now_arg(),
            len(buckets.rate_keys),
            len(buckets.slot_keys),
            len(buckets.budget_keys),
        ]
        for limit, cost in zip(buckets.rate_limits, costs, strict=True):
            args += (limit, cost)
        args += buckets.slot_limits
        for b, limit in enumerate(buckets.budget_limits):
            args += (limit, needs[b] if needs else 0)
        args += (slot_id, lease_us)
        reply = await self._run(buckets.keys, args)
        n_rate, n_slot = len(buckets.rate_keys), len(buckets.slot_keys)
        rate_end = 3 + 2 * n_rate
        return Decision(
            allowed=int(reply[0]) == 1,
            failed=int(reply[1]) - 1 if int(reply[1]) else None,
            retry_after_ms=int(reply[2]),
            remaining=tuple(int(v) for v in reply[3:rate_end:2]),
            reset_ms=tuple(int(v) for v in reply[4:rate_end:2]),
            slots_in_use=tuple(int(v) for v in reply[rate_end : rate_end + n_slot]),
            budget_used=tuple(int(v) for v in reply[rate_end + n_slot :]),
        )

    async def settle(
        self,
        buckets: BucketSet,
        deltas: Sequence[int],
        charges: Sequence[int],
        slot_id: str,
    ) -> None:
        args: list[str | int] = [
            "settle",
            self._now_arg(),
            len(buckets.rate_keys),
            len(buckets.slot_keys),
            len(buckets.budget_keys),
        ]
        for limit, delta in zip(buckets.rate_limits, deltas, strict=True):
            args += (limit, delta)
        args += charges
        args += (slot_id, self._budget_ttl_s)
        await self._run(buckets.keys, args)


class LocalLimiter:
    """The same buckets in process memory, each limit scaled by ``share``.

    Used by one gateway replica while Redis is unreachable: with ``share = 1 / replicas`` the
    replicas together admit no more than the shared limit would. Not shared between processes;
    safe across asyncio tasks of one event loop (no awaits inside an operation). Full buckets
    and empty slot sets are dropped as they are found, so memory follows the active tenants.
    """

    def __init__(self, *, share: float = 1.0, clock: Callable[[], int] = monotonic_us) -> None:
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        self._share = share
        self._clock = clock
        self._buckets: dict[str, tuple[float, int]] = {}  # key -> (tokens, stamp us)
        self._slots: dict[str, dict[str, int]] = {}  # key -> slot id -> lease end us
        self._budgets: dict[str, int] = {}  # key -> tokens used
        self._ops = 0

    def _scaled(self, limit: int) -> float:
        return limit * self._share

    def _slot_cap(self, limit: int) -> int:
        # A share of a concurrency limit rounds down but never to 0 slots: with 1 slot and 2
        # replicas, each replica must still be able to serve one request.
        return 0 if limit <= 0 else max(1, math.floor(self._scaled(limit)))

    def _level(self, key: str, capacity: float, now: int) -> float:
        state = self._buckets.get(key)
        if state is None:
            return capacity
        tokens, stamp = state
        return min(capacity, tokens + max(0, now - stamp) * capacity / US_PER_MINUTE)

    def _live_slots(self, key: str, now: int) -> dict[str, int]:
        slots = self._slots.get(key)
        if slots is None:
            return {}
        for slot_id in [s for s, end in slots.items() if end <= now]:
            del slots[slot_id]
        return slots

    async def acquire(
        self,
        buckets: BucketSet,
        costs: Sequence[int],
        slot_id: str,
        lease_us: int,
        needs: Sequence[int] = (),
    ) -> Decision:
        now = self._clock()
        self._maybe_sweep(now)
        failed: int | None = None
        retry_us = 0.0
        levels: list[float] = []
        for i, (key, limit) in enumerate(zip(buckets.rate_keys, buckets.rate_limits, strict=True)):
            capacity = self._scaled(limit)
            level = self._level(key, capacity, now)
            levels.append(level)
            if level < costs[i]:
                wait = (costs[i] - level) * US_PER_MINUTE / capacity
                if wait > retry_us:
                    failed, retry_us = i, wait
        n_rate = len(buckets.rate_keys)
        in_use: list[int] = []
        slot_failed: int | None = None
        for j, (key, limit) in enumerate(zip(buckets.slot_keys, buckets.slot_limits, strict=True)):
            in_use.append(len(self._live_slots(key, now)))
            if in_use[j] >= self._slot_cap(limit) and slot_failed is None:
                slot_failed = n_rate + j
        used: list[int] = []
        budget_failed: int | None = None
        first_budget = n_rate + len(buckets.slot_keys)
        for b, (key, limit) in enumerate(
            zip(buckets.budget_keys, buckets.budget_limits, strict=True)
        ):
            used.append(self._budgets.get(key, 0))
            scaled = self._scaled(limit)
            need = needs[b] if needs else 0
            if (used[b] >= scaled or used[b] + need > scaled) and budget_failed is None:
                budget_failed = first_budget + b
        if budget_failed is not None:
            failed = budget_failed
        elif slot_failed is not None:
            failed = slot_failed
        if failed is None:
            for i, key in enumerate(buckets.rate_keys):
                levels[i] -= costs[i]
                self._buckets[key] = (levels[i], now)
            for j, key in enumerate(buckets.slot_keys):
                self._slots.setdefault(key, {})[slot_id] = now + lease_us
                in_use[j] += 1
        resets = []
        for level, limit in zip(levels, buckets.rate_limits, strict=True):
            capacity = self._scaled(limit)
            full_in = 0.0 if level >= capacity else (capacity - level) * US_PER_MINUTE / capacity
            resets.append(math.ceil(full_in / 1000))
        return Decision(
            allowed=failed is None,
            failed=failed,
            retry_after_ms=math.ceil(retry_us / 1000),
            remaining=tuple(max(0, math.floor(level)) for level in levels),
            reset_ms=tuple(resets),
            slots_in_use=tuple(in_use),
            budget_used=tuple(used),
        )

    async def settle(
        self,
        buckets: BucketSet,
        deltas: Sequence[int],
        charges: Sequence[int],
        slot_id: str,
    ) -> None:
        now = self._clock()
        for key, limit, delta in zip(buckets.rate_keys, buckets.rate_limits, deltas, strict=True):
            if delta:
                capacity = self._scaled(limit)
                level = min(capacity, self._level(key, capacity, now) - delta)
                self._buckets[key] = (level, now)
        for key in buckets.slot_keys:
            slots = self._slots.get(key)
            if slots is not None:
                slots.pop(slot_id, None)
                if not slots:
                    del self._slots[key]
        for key, charge in zip(buckets.budget_keys, charges, strict=True):
            if charge > 0:
                self._budgets[key] = self._budgets.get(key, 0) + charge

    def seed_budget(self, key: str, used: int) -> None:
        """Start budget ``key`` from ``used`` tokens spent by all replicas (last seen in Redis).

        This replica then spends at most its share of what is left, so an outage does not hand
        a tenant its budget again. Never lowers what this replica has counted itself.
        """
        self._budgets[key] = max(self._budgets.get(key, 0), math.ceil(used * self._share))

    def _maybe_sweep(self, now: int) -> None:
        """Every 4096 operations, drop buckets that have refilled (absent means full)."""
        self._ops += 1
        if self._ops & 4095:
            return
        stale = []
        for key, (tokens, stamp) in self._buckets.items():
            # Without the limit at hand: a bucket idle for a whole minute is full for any limit
            # (refill per minute equals its capacity) unless it is in debt.
            if tokens >= 0 and now - stamp >= US_PER_MINUTE:
                stale.append(key)
        for key in stale:
            del self._buckets[key]
        for key in [k for k in self._slots if not self._live_slots(k, now)]:
            del self._slots[key]
