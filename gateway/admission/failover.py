"""The limiter admission uses: Redis while it answers, the ``redis_down_policy`` while it does not.

:class:`FailoverLimiter` wraps the shared :class:`~gateway.admission.limiter.RedisLimiter` and
the in-process :class:`~gateway.admission.limiter.LocalLimiter`, and is the only place that
decides whether Redis is up. A failed call is classified (:func:`failure_kind`): a replica that
got no timely turn on Redis answers 503 ``rate_limiter_busy`` (falling back would admit beyond
the shared limit); Redis itself gone switches to the policy (``local``: each replica enforces
its share of every limit; ``open``: admit everything; ``closed``: 503) until a background PING
gets an answer (on a Redis Cluster: until every master answers and reports the cluster ok,
:func:`gateway.store.ping_redis`). :meth:`FailoverLimiter.start_watch` also PINGs on a timer,
so the state (and the gateway's readiness) follows Redis when no request arrives. The switch is
logged once per outage and visible in ``portico_admission_redis_up`` and
``portico_admission_degraded_total``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from typing import Literal

import redis.exceptions
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.admission.limiter import BucketSet, Decision, Limiter, LocalLimiter
from gateway.store import RedisClient, ping_redis
from portico.errors import ServiceUnavailableError

log = logging.getLogger("portico.admission")

# Everything redis-py raises when a command did not get its answer. On a Redis Cluster:
# CLUSTERDOWN (a master lost, its slots uncovered), TRYAGAIN (a slot migrating), a slot no
# known node serves, or redirections that never settled (ClusterError "TTL exhausted").
REDIS_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    OSError,
)
FailureKind = Literal["busy", "slow", "down"]
RedisDownPolicy = Literal["local", "open", "closed"]
BUSY_LOG_INTERVAL_S = 60.0
MAX_BUDGETS_SEEN = 4096


def failure_kind(exc: BaseException) -> FailureKind:
    """What a failed Redis call says about Redis.

    ``busy``: this replica got no connection from its own pool (``MaxConnectionsError``, or a
    ``BlockingConnectionPool`` wait that timed out): the replica is overloaded, Redis is not
    known to be down, and falling back to local buckets would admit beyond the shared limit.
    ``slow``: a socket timed out (connecting or reading): Redis is down, or this replica is too
    loaded to read its answer in time; a PING decides. ``down``: refused, reset, socket gone,
    or a Redis Cluster that cannot serve the key's slot (CLUSTERDOWN and the like).
    A cluster's TRYAGAIN (its slot is being moved between nodes) is ``busy``: it passes.
    """
    if isinstance(exc, redis.exceptions.MaxConnectionsError | redis.exceptions.TryAgainError):
        return "busy"
    if isinstance(exc, redis.exceptions.ConnectionError) and isinstance(
        exc.__cause__, TimeoutError
    ):
        return "busy"
    if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
        return "slow"
    return "down"


class FailoverLimiter:
    """The shared limiter while Redis answers; the policy's fallback while it is down.

    :meth:`acquire` returns the decision with the limiter that made it, so a request is settled
    where it was admitted even when Redis goes down or comes back in between. Budgets Redis
    reported are remembered, so the local fallback starts from them instead of from zero.
    One instance per gateway process, used from one event loop.
    """

    def __init__(
        self,
        redis: RedisClient,
        shared: Limiter,
        local: LocalLimiter,
        *,
        policy: RedisDownPolicy,
        ping_timeout_s: float,
        probe_interval_s: float,
        registry: CollectorRegistry,
    ) -> None:
        self._redis = redis
        self.shared = shared
        self.local = local
        self.policy = policy
        self._ping_timeout_s = ping_timeout_s
        self._probe_interval_s = probe_interval_s
        self._budgets_seen: dict[str, int] = {}
        self._redis_up = True
        self._last_probe = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._up_gauge = Gauge(
            "portico_admission_redis_up", "1 while admission reaches Redis", registry=registry
        )
        self._up_gauge.set(1)
        self._degraded = Counter(
            "portico_admission_degraded",
            "Admissions decided without Redis, by policy",
            ["policy"],
            registry=registry,
        )
        self._busy = Counter(
            "portico_admission_busy",
            "Admissions and settlements that got no timely turn on Redis (503, Redis not down)",
            registry=registry,
        )
        self._last_busy_log = -math.inf

    @property
    def redis_up(self) -> bool:
        return self._redis_up

    async def acquire(
        self,
        buckets: BucketSet,
        costs: list[int],
        slot_id: str,
        lease_us: int,
        needs: Sequence[int] = (),
    ) -> tuple[Decision, Limiter] | None:
        """The decision and the limiter that made it; None: admit unlimited (policy ``open``).

        Raises ServiceUnavailableError: ``rate_limiter_busy`` when this replica got no timely
        answer, ``rate_limiter_unavailable`` under policy ``closed`` while Redis is down.
        """
        limiter = self._limiter_now()
        if limiter is None:
            return None
        try:
            decision = await limiter.acquire(buckets, costs, slot_id, lease_us, needs)
        except REDIS_ERRORS as exc:
            if failure_kind(exc) != "down":
                self._note_busy(exc)
                raise ServiceUnavailableError(
                    "The gateway is overloaded; try again shortly.",
                    code="rate_limiter_busy",
                    headers={"retry-after": "1"},
                ) from exc
            self._mark_down(exc)
            limiter = self._limiter_now()
            if limiter is None:
                return None
            decision = await limiter.acquire(buckets, costs, slot_id, lease_us, needs)
        if decision.budget_used and limiter is self.shared:
            self._remember_budgets(buckets.budget_keys, decision.budget_used)
        return decision, limiter

    async def settle(
        self,
        limiter: Limiter,
        buckets: BucketSet,
        deltas: list[int],
        charges: list[int],
        slot_id: str,
    ) -> None:
        """Settle on ``limiter`` (the one that admitted). A Redis failure is swallowed: the
        reservation stays charged and the slot's lease frees it; the client's response is
        already on its way."""
        try:
            await limiter.settle(buckets, deltas, charges, slot_id)
            if charges and limiter is self.shared:
                seen = self._budgets_seen
                for key, charge in zip(buckets.budget_keys, charges, strict=True):
                    seen[key] = seen.get(key, 0) + charge
        except REDIS_ERRORS as exc:
            if failure_kind(exc) == "down":
                self._mark_down(exc)
            else:
                self._note_busy(exc)

    def start_watch(self) -> None:
        """Probe Redis on a timer (``probe_interval_s``) for the life of the gateway.

        The probe, not only a failing request, decides :attr:`redis_up`: the gauge and
        readiness follow the store's real state even when no request arrives (an alert can
        fire), and after an outage Redis is found again before the next request, which is then
        judged by the shared buckets, not by the local fallback it no longer needs."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            if self._probe is None:
                self._start_probe()

    async def aclose(self) -> None:
        """Stop the background Redis probes (the timed watch and any PING in flight)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None

    # ----------------------------------------------------------------- internals

    def _limiter_now(self) -> Limiter | None:
        """The limiter to use now: Redis, or the policy's fallback (None: admit unlimited)."""
        if self._redis_up:
            return self.shared
        self._maybe_probe()
        self._degraded.labels(self.policy).inc()
        if self.policy == "closed":
            raise ServiceUnavailableError(
                "Rate limiting is unavailable (its store cannot be reached); try again shortly.",
                code="rate_limiter_unavailable",
                headers={"retry-after": "1"},
            )
        return self.local if self.policy == "local" else None

    def _note_busy(self, exc: BaseException) -> None:
        self._busy.inc()
        if failure_kind(exc) == "slow":
            self._start_probe()  # down, or only slow? a PING decides
        now = time.monotonic()
        if now - self._last_busy_log >= BUSY_LOG_INTERVAL_S:
            self._last_busy_log = now
            log.warning(
                "admission: no timely answer from Redis (%s: %s); answering 503 (size the "
                "Redis connection pool and socket timeouts for the load)",
                type(exc).__name__,
                exc,
            )

    def _remember_budgets(self, keys: tuple[str, ...], used: tuple[int, ...]) -> None:
        if len(self._budgets_seen) >= MAX_BUDGETS_SEEN:
            self._budgets_seen.clear()
        for key, value in zip(keys, used, strict=True):
            self._budgets_seen[key] = value

    def _mark_down(self, exc: BaseException) -> None:
        if self._redis_up:
            for key, used in self._budgets_seen.items():
                self.local.seed_budget(key, used)
            self._redis_up = False
            self._last_probe = time.monotonic()
            self._up_gauge.set(0)
            log.warning(
                "admission: Redis unreachable (%s: %s); policy %r until it answers again",
                type(exc).__name__,
                exc,
                self.policy,
            )

    def _maybe_probe(self) -> None:
        if time.monotonic() - self._last_probe >= self._probe_interval_s:
            self._start_probe()

    def _start_probe(self) -> None:
        if self._probe is None:
            self._last_probe = time.monotonic()
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())

    async def _run_probe(self) -> None:
        """PING Redis once: mark it down if it fails, up again if it answers."""
        try:
            async with asyncio.timeout(self._ping_timeout_s):
                await ping_redis(self._redis)
        except (*REDIS_ERRORS, TimeoutError) as exc:
            self._mark_down(exc)
            return
        finally:
            self._probe = None
        if not self._redis_up:
            self._redis_up = True
            self._up_gauge.set(1)
            log.warning("admission: Redis reachable again; limits are shared again")
