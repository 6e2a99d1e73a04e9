"""Money budgets at admission: the gauges they are shown as, and the completion size the
tightest one still pays for.

The mechanism (check before the request, charge after it, atomically with the token buckets)
is the limiter's budgets (gateway/admission/limiter.lua); this module only reads what an
admission saw. All amounts are integer micro-dollars.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from gateway.identity.prices import MICRO, ModelPrice


@dataclass(frozen=True, slots=True)
class MoneyLeft:
    """One money budget of a request as its admission saw it."""

    label: str  # e.g. "daily_budget_usd of key 'k1' of tenant 'acme'"
    scope: str  # "tenant" | "key" | "model"
    period: str  # "daily" | "monthly"
    limit: int  # micro-dollars per period
    used: int  # micro-dollars spent this period before the request

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used)


class BudgetGauges:
    """Tenants' money budgets as Prometheus gauges, as of each tenant's last admission (a
    dashboard's "% spent"). Tenant scope only, so label values stay bounded by the tenants."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._limit = Gauge(
            "portico_spend_budget_usd",
            "A tenant's money budget per period (USD), as of its last admission",
            ["tenant", "period"],
            registry=registry,
        )
        self._spent = Gauge(
            "portico_spend_budget_spent_usd",
            "What a tenant had spent of its money budget this period (USD) at its last admission",
            ["tenant", "period"],
            registry=registry,
        )

    def show(self, tenant_id: str, budgets: Iterable[MoneyLeft]) -> None:
        for budget in budgets:
            if budget.scope == "tenant":
                self._limit.labels(tenant_id, budget.period).set(budget.limit / MICRO)
                self._spent.labels(tenant_id, budget.period).set(budget.used / MICRO)


def money_cap(
    budgets: Iterable[MoneyLeft],
    price: ModelPrice | None,
    prompt_tokens: int,
    num_outputs: int,
    num_images: int = 0,
) -> tuple[int, MoneyLeft] | None:
    """The most completion tokens per output that the tightest budget still pays for at
    ``price`` after the prompt (all of it at the input price: which part the cache holds is
    known only afterwards) and its images, at least 1, and that budget; None when output is
    free or unpriced.
    """
    if price is None:
        return None
    input_units, _, output_units = price.units
    if output_units <= 0:
        return None
    tightest: tuple[int, MoneyLeft] | None = None
    for budget in budgets:
        # micro-dollars x 1e6 over micro-dollars per 1M tokens: tokens, rounded down
        affordable = (budget.left - num_images * price.image_units) * MICRO
        affordable -= prompt_tokens * input_units
        cap = max(1, affordable // (output_units * max(1, num_outputs)))
        if tightest is None or cap < tightest[0]:
            tightest = (cap, budget)
    return tightest


def money_needs(
    money: tuple[bool, ...],
    price: ModelPrice | None,
    prompt_tokens: int,
    num_outputs: int,
    num_images: int = 0,
) -> tuple[int, ...]:
    """Per budget (``money``: which are money budgets), the micro-dollars a request surely
    costs: its prompt at the input price, its images at the image price and one output token
    per completion, rounded up.
    Admission refuses when that does not fit in what a money budget has left, so no budget
    pays for more than it holds. 0 for token budgets; empty for an unpriced model."""
    if price is None:
        return ()
    input_units, _, output_units = price.units
    least = -(-(prompt_tokens * input_units + num_outputs * output_units) // MICRO)
    least += num_images * price.image_units
    return tuple(least if is_money else 0 for is_money in money)


def money_refusal(limit_name: str, who: str, used: int, limit: int, need: int) -> str:
    """The 429 ``budget_exceeded`` message: the budget is spent, or (``used`` below ``limit``)
    what is left cannot pay for the request's prompt."""
    period = "today" if limit_name.startswith("daily") else "this month"
    renews = "at 00:00 UTC" if period == "today" else "at the start of next month (UTC)"
    spent = f"${used / MICRO:.6f} of ${limit / MICRO:.2f} spent {period} (UTC)"
    if used >= limit:
        return f"You exceeded the {limit_name} of {who}: {spent}. It renews {renews}."
    return (
        f"This request costs at least ${need / MICRO:.6f} (its prompt and one output token) "
        f"and the {limit_name} of {who} has only ${(limit - used) / MICRO:.6f} left: {spent}. "
        f"Shorten the prompt, or wait: it renews {renews}."
    )


def utc_day(epoch_s: float) -> str:
    """The UTC date of ``epoch_s`` (the period of daily budgets; POSIX days are 86,400 s),
    formatted once per day: every request asks, and gmtime plus formatting showed in the
    gateway's profile (docs/benchmarks.md, issue 44)."""
    return _day_text(int(epoch_s // 86_400))


@functools.lru_cache(maxsize=4)
def _day_text(day_number: int) -> str:
    t = time.gmtime(day_number * 86_400)
    return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}"
