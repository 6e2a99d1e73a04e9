"""Admission: which buckets a request touches, what it reserves, and what the client is told.

The policy half of rate limiting (the mechanism is :mod:`gateway.admission.limiter`). For one
request it builds the bucket set (tenant, key and model scopes; requests/min, tokens/min,
concurrency, monthly token budget, daily or monthly money budget), reserves tokens (exact prompt
tokens + max_tokens, or a capped default), turns a refusal into a 429 in OpenAI's shape with an
exact ``retry-after``, and writes OpenAI's ``x-ratelimit-*`` headers. Which limiter decides
(Redis, or a fallback while it is down) is :class:`~gateway.admission.failover.FailoverLimiter`'s.

The dataplane calls, per request::

    ticket = await admission.admit(principal, model, prompt_tokens, max_tokens)
    try:
        ...                                   # forward; add ticket.headers to the response
        await admission.settle(ticket, prompt_tokens, completion_tokens)
    finally:
        await admission.release(ticket)       # no-op after settle; frees the slot otherwise
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field

from gateway.admission.abuse import AbuseSettings
from gateway.admission.failover import FailoverLimiter, RedisDownPolicy
from gateway.admission.limiter import (
    BucketSet,
    Decision,
    Limiter,
    LocalLimiter,
    RedisLimiter,
    format_duration,
)
from gateway.admission.spend import (
    BudgetGauges,
    MoneyLeft,
    money_cap,
    money_needs,
    money_refusal,
    utc_day,
)
from gateway.identity.prices import PriceBook, usd_to_micro
from gateway.identity.principal import Limits, Principal
from gateway.store import RedisClient
from portico.errors import RateLimitError

PLAN_CACHE_SIZE = 4096
# With no max_tokens asked or reserved, a token budget's remainder is sent as the engine's cap
# only up to this (any model generates that much; a larger cap could exceed its context).
UNASKED_BUDGET_CAP = 4096
CONCURRENCY_RETRY_MS = 1000
# A reply whose max_tokens a budget lowered: the cap, and the budget that set it (docs/api.md)
BUDGET_MAX_TOKENS_HEADER = "x-portico-budget-max-tokens"
BUDGET_STOP_HEADER = "x-portico-budget-stop"


class AdmissionSettings(BaseModel):
    """Admission configuration (``admission:`` in the gateway config)."""

    model_config = ConfigDict(extra="forbid")

    # What to do while Redis is unreachable: `local` enforces limit / replicas in each replica,
    # `open` admits everything, `closed` answers 503.
    redis_down_policy: RedisDownPolicy = "local"
    # gateway replicas sharing the Redis (each enforces 1/replicas of a limit under `local`)
    replicas: int = Field(default=1, ge=1)
    # a concurrency slot frees itself after this, so a crashed replica cannot hold it forever
    slot_lease_seconds: float = Field(default=600.0, gt=0)
    # how long a month's budget counter lives after its last charge (last month stays readable)
    budget_key_ttl_seconds: int = Field(default=62 * 86400, ge=86400)
    # How long the PING that decides whether Redis is down may take. Admissions themselves
    # wait as long as the client's socket_timeout / socket_connect_timeout allow: set those
    # small (a wait for a free pool connection is overload, not an outage).
    redis_timeout_seconds: float = Field(default=2.0, gt=0)
    # while Redis is down, a background PING at most this often finds out when it is back
    probe_interval_seconds: float = Field(default=1.0, gt=0)
    abuse: AbuseSettings = Field(default_factory=AbuseSettings)


class InsufficientQuotaError(RateLimitError):
    """The tenant's monthly token budget is spent (OpenAI's ``insufficient_quota``)."""

    error_type = "insufficient_quota"
    default_code = "insufficient_quota"


class LimitExceededError(RateLimitError):
    """A rate or concurrency limit refused the request; ``limit`` and ``scope`` say which."""

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        scope: str,
        headers: dict[str, str],
        code: str = "rate_limit_exceeded",
    ) -> None:
        super().__init__(message, code=code, headers=headers)
        self.limit = limit
        self.scope = scope


class BudgetExceededError(LimitExceededError):
    """A money budget (``daily_budget_usd`` / ``monthly_budget_usd`` of a tenant, key or model)
    is spent: 429 ``budget_exceeded``, not worth retrying before the period renews."""

    error_type = "insufficient_quota"


@dataclass(frozen=True, slots=True)
class _Bucket:
    scope: str  # "tenant" | "key" | "model"
    limit_name: str  # "requests_per_minute" | "tokens_per_minute" | ...
    who: str  # for messages: "tenant 'acme'", "key 'k1' of tenant 'acme'", ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything about a (principal, model, month) that does not change per request."""

    buckets: BucketSet
    described: tuple[_Bucket, ...]  # parallel to buckets.keys
    money: tuple[bool, ...]  # per budget: micro-dollars (True) or tokens
    has_money: bool
    counts_tokens: tuple[bool, ...]  # per rate bucket: tokens/min (True) or requests/min
    min_tokens_per_minute: int | None
    max_tokens_default: int | None
    closed: _Bucket | None  # a rate or concurrency limit of 0: nothing is ever admitted


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request: what it reserved and where, until it is settled or released.

    ``headers`` are the ``x-ratelimit-*`` headers for the response. Settling or releasing a
    ticket twice does nothing the second time.
    """

    headers: dict[str, str]
    reserved_tokens: int
    _plan: _Plan | None
    _limiter: Limiter | None
    _slot_id: str
    _done: bool = False
    # The max_tokens per completion the reservation covers when the client set none: the
    # gateway sends it to the engine, so no completion generates more than was reserved.
    # Also set, below what the client asked, when the tenant's token budget has less left
    # (``budget_stop`` then names that budget, for the client's final stream event).
    max_tokens: int | None = None
    budget_stop: str | None = None

    @property
    def done(self) -> bool:
        return self._done


def _cap_at_token_budget(
    ticket: Ticket,
    plan: _Plan,
    decision: Decision,
    prompt_tokens: int,
    max_tokens: int | None,
    num_outputs: int,
) -> None:
    """Lower ``ticket.max_tokens`` to what the tightest monthly token budget has left after
    the prompt (shared by the request's completions), when that is less than the request may
    otherwise generate. The engine then stops by itself (``finish_reason: "length"``) the step
    the budget runs out. Budgets are charged at settle, so requests of one tenant running at
    once each see the same remainder: together they may pass it by what they generate."""
    first = len(plan.buckets.rate_keys) + len(plan.buckets.slot_keys)
    tightest: tuple[int, _Bucket] | None = None
    for b, used in enumerate(decision.budget_used):
        bucket = plan.described[first + b]
        if bucket.limit_name != "monthly_token_budget":
            continue
        left = plan.buckets.budget_limits[b] - used
        if tightest is None or left < tightest[0]:
            tightest = (left, bucket)
    if tightest is None:
        return
    cap = max(1, (tightest[0] - prompt_tokens) // max(1, num_outputs))
    asked = max_tokens if max_tokens is not None else ticket.max_tokens
    if asked is not None and asked <= cap:
        return
    if asked is None and cap > UNASKED_BUDGET_CAP:
        return  # a cap that large could pass the model's own limit: let the engine decide
    ticket.max_tokens = cap
    ticket.budget_stop = f"{tightest[1].limit_name} of {tightest[1].who}"
    ticket.headers[BUDGET_MAX_TOKENS_HEADER] = str(cap)


def _money_left(plan: _Plan, decision: Decision) -> tuple[MoneyLeft, ...]:
    first = len(plan.buckets.rate_keys) + len(plan.buckets.slot_keys)
    out = []
    for b, money in enumerate(plan.money):
        if money:
            bucket = plan.described[first + b]
            period = "daily" if bucket.limit_name.startswith("daily") else "monthly"
            label = f"{bucket.limit_name} of {bucket.who}"
            limit = plan.buckets.budget_limits[b]
            out.append(MoneyLeft(label, bucket.scope, period, limit, decision.budget_used[b]))
    return tuple(out)


def utc_month(epoch_s: float) -> str:
    t = time.gmtime(epoch_s)
    return f"{t.tm_year:04d}-{t.tm_mon:02d}"


class Admission:
    """Decides whether a request may start, and accounts for it when it ends.

    Limits hold exactly across replicas through :class:`RedisLimiter`; while Redis is down the
    ``redis_down_policy`` applies (:class:`FailoverLimiter`, built here from ``limiter`` and
    ``local_limiter``, makes that decision and returns to Redis by itself). With ``prices``,
    a completion is capped at what the tightest money budget still pays for (spend.py).
    """

    def __init__(
        self,
        redis: RedisClient,
        settings: AdmissionSettings,
        *,
        registry: CollectorRegistry | None = None,
        limiter: Limiter | None = None,
        local_limiter: LocalLimiter | None = None,
        wall_clock: Callable[[], float] = time.time,
        prices: PriceBook | None = None,
    ) -> None:
        self.settings = settings
        registry = registry if registry is not None else CollectorRegistry()
        self._limiter = FailoverLimiter(
            redis,
            limiter or RedisLimiter(redis, budget_ttl_s=settings.budget_key_ttl_seconds),
            local_limiter or LocalLimiter(share=1 / settings.replicas),
            policy=settings.redis_down_policy,
            ping_timeout_s=settings.redis_timeout_seconds,
            probe_interval_s=settings.probe_interval_seconds,
            registry=registry,
        )
        self._wall_clock = wall_clock
        self._lease_us = int(settings.slot_lease_seconds * 1_000_000)
        self._plans: dict[tuple[object, ...], _Plan] = {}
        self._rejected = Counter(
            "portico_admission_rejected",
            "Requests refused by admission, by scope and limit",
            ["scope", "limit"],
            registry=registry,
        )
        self._gauges = BudgetGauges(registry)
        self._prices = prices

    @property
    def redis_up(self) -> bool:
        return self._limiter.redis_up

    # ----------------------------------------------------------------- the request path

    async def admit(
        self,
        principal: Principal,
        model: str,
        prompt_tokens: int,
        max_tokens: int | None,
        num_outputs: int = 1,
        num_images: int = 0,
    ) -> Ticket:
        """Admit one request or raise (``num_images``: input images, for an image price).

        Raises :class:`LimitExceededError` (429, ``retry-after``), :class:`InsufficientQuotaError`
        (429, ``x-should-retry: false``) or ``ServiceUnavailableError`` (503: code
        ``rate_limiter_unavailable`` under policy ``closed`` while Redis is down,
        ``rate_limiter_busy`` when this replica got no timely answer from Redis). A refused
        request is charged nothing.
        """
        plan = self._plan_for(principal, model)
        slot_id = f"{random.getrandbits(64):016x}"  # unique, not secret: no getrandom call
        if plan.buckets.empty:
            return Ticket({}, 0, None, None, slot_id)
        if plan.closed is not None:
            self._rejected.labels(plan.closed.scope, plan.closed.limit_name).inc()
            raise LimitExceededError(
                f"The {plan.closed.limit_name} limit of {plan.closed.who} is 0: "
                "no request is admitted.",
                limit=plan.closed.limit_name,
                scope=plan.closed.scope,
                headers={"x-should-retry": "false"},
            )
        reserved, cap = self._reservation(plan, prompt_tokens, max_tokens, num_outputs)
        costs = [reserved if tokens else 1 for tokens in plan.counts_tokens]
        needs = self._money_needs(plan, model, prompt_tokens, num_outputs, num_images)
        outcome = await self._limiter.acquire(plan.buckets, costs, slot_id, self._lease_us, needs)
        if outcome is None:  # Redis down, policy "open": admitted without limits
            return Ticket({}, 0, None, None, slot_id)
        decision, limiter = outcome
        money = _money_left(plan, decision) if plan.has_money else ()
        self._gauges.show(principal.tenant_id, money)
        headers = self._headers(plan, decision)
        if not decision.allowed:
            self._refuse(plan, decision, costs, headers, needs)
        ticket = Ticket(headers, reserved, plan, limiter, slot_id, max_tokens=cap)
        _cap_at_token_budget(ticket, plan, decision, prompt_tokens, max_tokens, num_outputs)
        if money and self._prices is not None:  # the completion the money left pays for
            price = self._prices.get(model)
            capped = money_cap(money, price, prompt_tokens, num_outputs, num_images)
            current = ticket.max_tokens if ticket.max_tokens is not None else max_tokens
            if capped is not None and (current is None or capped[0] < current):
                ticket.max_tokens = capped[0]
                ticket.budget_stop = capped[1].label
                ticket.headers[BUDGET_MAX_TOKENS_HEADER] = str(capped[0])
        if ticket.budget_stop is not None:
            ticket.headers[BUDGET_STOP_HEADER] = ticket.budget_stop
        return ticket

    def _money_needs(
        self, plan: _Plan, model: str, prompt_tokens: int, num_outputs: int, num_images: int
    ) -> tuple[int, ...]:
        if not plan.has_money or self._prices is None:
            return ()
        return money_needs(
            plan.money, self._prices.get(model), prompt_tokens, num_outputs, num_images
        )

    async def settle(
        self,
        ticket: Ticket,
        prompt_tokens: int,
        completion_tokens: int,
        spend_micro_usd: int = 0,
    ) -> None:
        """Settle the token reservation with the real usage and free the slot (one round trip).

        Refunds what was reserved and not used, charges what was used beyond it (the bucket may
        go into debt), charges the monthly token budget and adds ``spend_micro_usd`` (the
        request's price, :meth:`gateway.identity.prices.PriceBook.spend_micro_usd`) to every
        money budget. A stream cut short settles what it produced.
        """
        used = max(0, prompt_tokens) + max(0, completion_tokens)
        await self._finish(ticket, used, max(0, spend_micro_usd))

    async def refund(self, ticket: Ticket) -> None:
        """Give back everything the ticket took (its request, its token reservation, its
        slot): the upstream refused the request's input, so it cost nothing. Idempotent."""
        await self._finish(ticket, None, refund=True)

    async def release(self, ticket: Ticket) -> None:
        """Free the ticket's concurrency slot. Idempotent; a no-op after :meth:`settle`.

        Call it on every path (``finally``). Without a settle the token reservation stays
        charged (usage unknown) and nothing is charged to the monthly budget.
        """
        await self._finish(ticket, None)

    def start_watch(self) -> None:
        """Probe Redis on a timer for the life of the gateway (see
        :meth:`FailoverLimiter.start_watch`); :meth:`aclose` stops it."""
        self._limiter.start_watch()

    async def aclose(self) -> None:
        """Stop the background Redis probes (the timed watch and any PING in flight)."""
        await self._limiter.aclose()

    # ----------------------------------------------------------------- internals

    async def _finish(
        self, ticket: Ticket, used: int | None, spend: int = 0, refund: bool = False
    ) -> None:
        if ticket._done:
            return
        ticket._done = True
        plan, limiter = ticket._plan, ticket._limiter
        if plan is None or limiter is None:
            return
        if refund:  # the request and its token reservation given back
            deltas = [-ticket.reserved_tokens if tokens else -1 for tokens in plan.counts_tokens]
            charges = [0] * len(plan.buckets.budget_keys)
        elif used is None:
            deltas = [0] * len(plan.counts_tokens)
            charges = [0] * len(plan.buckets.budget_keys)
        else:
            delta = used - ticket.reserved_tokens
            deltas = [delta if tokens else 0 for tokens in plan.counts_tokens]
            charges = [spend if money else used for money in plan.money]
        await self._limiter.settle(limiter, plan.buckets, deltas, charges, ticket._slot_id)

    def _reservation(
        self, plan: _Plan, prompt_tokens: int, max_tokens: int | None, num_outputs: int
    ) -> tuple[int, int | None]:
        """(tokens to reserve, the max_tokens the engine must be sent or None when the client
        set one). Every completion the request asks for (``num_outputs``) is reserved."""
        tpm = plan.min_tokens_per_minute
        cap: int | None = None
        if max_tokens is None:
            # The plan's default cap, lowered so that a request that fits the tokens/min limit
            # with its prompt is never refused for a completion size the client did not ask for.
            caps = [] if tpm is None else [(tpm - prompt_tokens) // num_outputs]
            if plan.max_tokens_default is not None:
                caps.append(plan.max_tokens_default)
            if caps:
                cap = max(1, min(caps))
            max_tokens = cap or 0
        reserved = prompt_tokens + max_tokens * num_outputs
        if tpm is not None and reserved > tpm:
            self._rejected.labels("request", "tokens_per_minute").inc()
            outputs = f" x {num_outputs} completions" if num_outputs > 1 else ""
            raise LimitExceededError(
                f"Request too large: it needs {reserved} tokens ({prompt_tokens} prompt + "
                f"{max_tokens} max_tokens{outputs}) and the tokens_per_minute limit is {tpm}. "
                "Shorten the prompt or lower max_tokens or n.",
                limit="tokens_per_minute",
                scope="request",
                headers={"x-should-retry": "false"},
            )
        return reserved, cap

    def _refuse(
        self,
        plan: _Plan,
        decision: Decision,
        costs: list[int],
        headers: dict[str, str],
        needs: tuple[int, ...] = (),
    ) -> None:
        index = decision.failed if decision.failed is not None else 0
        bucket = plan.described[index]
        limit = plan.buckets.limits[index]
        self._rejected.labels(bucket.scope, bucket.limit_name).inc()
        n_rate = len(plan.buckets.rate_keys)
        n_slot = len(plan.buckets.slot_keys)
        if index >= n_rate + n_slot and plan.money[index - n_rate - n_slot]:
            used = decision.budget_used[index - n_rate - n_slot]
            need = needs[index - n_rate - n_slot] if needs else 0
            raise BudgetExceededError(
                money_refusal(bucket.limit_name, bucket.who, used, limit, need),
                limit=bucket.limit_name,
                scope=bucket.scope,
                headers={**headers, "x-should-retry": "false"},
                code="budget_exceeded",
            )
        if index >= n_rate + n_slot:
            used = decision.budget_used[index - n_rate - n_slot]
            raise InsufficientQuotaError(
                f"You exceeded the monthly_token_budget of {bucket.who}: {used} of {limit} "
                "tokens used this month (UTC). It renews at the start of next month.",
                headers={**headers, "x-should-retry": "false"},
            )
        if index >= n_rate:
            message = (
                f"Rate limit reached for {bucket.who} on max_concurrency: limit {limit} "
                "requests in flight. Please try again when one finishes."
            )
            retry_ms = max(decision.retry_after_ms, CONCURRENCY_RETRY_MS)
        else:
            retry_ms = decision.retry_after_ms
            message = (
                f"Rate limit reached for {bucket.who} on {bucket.limit_name}: limit {limit}, "
                f"remaining {decision.remaining[index]}, requested {costs[index]}. "
                f"Please try again in {format_duration(retry_ms)}."
            )
        retry_ms = max(1, retry_ms)
        raise LimitExceededError(
            message,
            limit=bucket.limit_name,
            scope=bucket.scope,
            headers={
                **headers,
                "retry-after": str(math.ceil(retry_ms / 1000)),
                "retry-after-ms": str(retry_ms),
            },
        )

    @staticmethod
    def _headers(plan: _Plan, decision: Decision) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, from the tightest bucket of each kind."""
        headers: dict[str, str] = {}
        for kind, tokens in (("requests", False), ("tokens", True)):
            best = -1
            for i, counts in enumerate(plan.counts_tokens):
                if counts == tokens and (
                    best < 0 or decision.remaining[i] < decision.remaining[best]
                ):
                    best = i
            if best >= 0:
                headers[f"x-ratelimit-limit-{kind}"] = str(plan.buckets.rate_limits[best])
                headers[f"x-ratelimit-remaining-{kind}"] = str(decision.remaining[best])
                headers[f"x-ratelimit-reset-{kind}"] = format_duration(decision.reset_ms[best])
        return headers

    def _plan_for(self, principal: Principal, model: str) -> _Plan:
        day = utc_day(self._wall_clock())  # money budgets may be daily
        month = day[:7]
        model_limits = principal.model_limits.get(model)
        cache_key = (
            principal.tenant_id,
            principal.key_id,
            model,
            day,
            principal.limits,
            principal.key_limits,
            model_limits,
        )
        plan = self._plans.get(cache_key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.clear()
            plan = build_plan(principal, model, model_limits, month, day)
            self._plans[cache_key] = plan
        return plan


def _scopes(
    principal: Principal, model: str, model_limits: Limits | None
) -> list[tuple[str, str, str, Limits]]:
    """(scope, key prefix, who for messages, limits) of each level that limits the request:
    the tenant, its key where the key has limits of its own, the model where the plan has."""
    tenant = principal.tenant_id
    base = f"portico:rl:{{{tenant}}}"
    scopes: list[tuple[str, str, str, Limits]] = [
        ("tenant", f"{base}:t", f"tenant '{tenant}'", principal.limits)
    ]
    if principal.key_id is not None and principal.key_limits is not None:
        who = f"key '{principal.key_id}' of tenant '{tenant}'"
        scopes.append(("key", f"{base}:k:{principal.key_id}", who, principal.key_limits))
    if model_limits is not None:
        who = f"model '{model}' for tenant '{tenant}'"
        scopes.append(("model", f"{base}:m:{model}", who, model_limits))
    return scopes


def build_plan(
    principal: Principal,
    model: str,
    model_limits: Limits | None,
    month: str,
    day: str | None = None,
) -> _Plan:
    """The bucket set of (principal, model) this month (and UTC ``day``, for daily money
    budgets), with key names in their final form.

    Keys share the hash tag ``{tenant}`` so one script can touch them all on a Redis Cluster.
    Money budgets are budgets like the token one (checked at admission, charged at settle, by
    the same script) whose unit is the micro-dollar.
    """
    rate: list[tuple[str, int, _Bucket, bool]] = []
    slots: list[tuple[str, int, _Bucket]] = []
    budgets: list[tuple[str, int, _Bucket, bool]] = []
    for scope, prefix, who, limits in _scopes(principal, model, model_limits):
        if limits.requests_per_minute is not None:
            bucket = _Bucket(scope, "requests_per_minute", who)
            rate.append((f"{prefix}:rpm", limits.requests_per_minute, bucket, False))
        if limits.tokens_per_minute is not None:
            bucket = _Bucket(scope, "tokens_per_minute", who)
            rate.append((f"{prefix}:tpm", limits.tokens_per_minute, bucket, True))
        if limits.max_concurrency is not None:
            bucket = _Bucket(scope, "max_concurrency", who)
            slots.append((f"{prefix}:conc", limits.max_concurrency, bucket))
        if limits.monthly_token_budget is not None:
            bucket = _Bucket(scope, "monthly_token_budget", who)
            budget_key = prefix.replace("portico:rl:", "portico:budget:", 1) + f":{month}"
            budgets.append((budget_key, limits.monthly_token_budget, bucket, False))
        if limits.budget_usd is not None:
            daily = limits.budget_period == "daily"
            if daily and day is None:
                raise ValueError("a daily money budget needs the UTC day")
            period = f"d:{day}" if daily else f"m:{month}"
            bucket = _Bucket(scope, "daily_budget_usd" if daily else "monthly_budget_usd", who)
            spend_key = prefix.replace("portico:rl:", "portico:spend:", 1) + f":{period}"
            budgets.append((spend_key, usd_to_micro(limits.budget_usd), bucket, True))
    tpms = [limit for _, limit, _, tokens in rate if tokens]
    default_cap = principal.limits.max_tokens_default
    if principal.key_limits is not None and principal.key_limits.max_tokens_default is not None:
        default_cap = principal.key_limits.max_tokens_default
    described = [r[2] for r in rate] + [s[2] for s in slots] + [b[2] for b in budgets]
    return _Plan(
        buckets=BucketSet(
            rate_keys=tuple(r[0] for r in rate),
            rate_limits=tuple(r[1] for r in rate),
            slot_keys=tuple(s[0] for s in slots),
            slot_limits=tuple(s[1] for s in slots),
            budget_keys=tuple(b[0] for b in budgets),
            budget_limits=tuple(b[1] for b in budgets),
            labels=tuple(f"{d.scope} {d.limit_name}" for d in described),
        ),
        described=tuple(described),
        money=tuple(b[3] for b in budgets),
        has_money=any(b[3] for b in budgets),
        counts_tokens=tuple(r[3] for r in rate),
        min_tokens_per_minute=min(tpms) if tpms else None,
        max_tokens_default=default_cap,
        closed=next((r[2] for r in rate if r[1] <= 0), None)
        or next((s[2] for s in slots if s[1] <= 0), None),
    )
