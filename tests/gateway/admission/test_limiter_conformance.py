"""The conformance suite every Limiter implementation passes: Redis (limiter.lua) on one server
and on a Redis Cluster of three masters, and local.

Both run on the same fake clock, which moves only when a test moves it, so every number here
is exact: how long the machine takes does not enter.
"""

from __future__ import annotations

import itertools

import pytest

from gateway.admission.limiter import BucketSet, Limiter

LEASE_US = 600 * 1_000_000
_ids = itertools.count()


def buckets(
    *,
    rpm: int | None = None,
    tpm: int | None = None,
    concurrency: int | None = None,
    budget: int | None = None,
    name: str = "b",
    tag: str | None = None,
) -> BucketSet:
    """A fresh bucket set; every key carries one hash tag (``tag``, else a new one), as the
    keys of one admission do, so the script runs in one slot of a cluster."""
    tag = f"{{{tag or f'conf{next(_ids)}'}}}:{name}"
    rate = [(f"portico:test:{tag}:rpm", rpm)] if rpm is not None else []
    if tpm is not None:
        rate.append((f"portico:test:{tag}:tpm", tpm))
    return BucketSet(
        rate_keys=tuple(k for k, _ in rate),
        rate_limits=tuple(v for _, v in rate),
        slot_keys=(f"portico:test:{tag}:conc",) if concurrency is not None else (),
        slot_limits=(concurrency,) if concurrency is not None else (),
        budget_keys=(f"portico:test:{tag}:budget",) if budget is not None else (),
        budget_limits=(budget,) if budget is not None else (),
    )


async def admit_many(limiter: Limiter, bs: BucketSet, n: int, cost: int = 1) -> int:
    admitted = 0
    for i in range(n):
        decision = await limiter.acquire(bs, [cost] * len(bs.rate_keys), f"s{i}", LEASE_US)
        admitted += decision.allowed
    return admitted


async def test_burst_is_the_per_minute_limit(limiter: Limiter) -> None:
    bs = buckets(rpm=100)
    assert await admit_many(limiter, bs, 100) == 100
    refused = await limiter.acquire(bs, [1], "x", LEASE_US)
    assert not refused.allowed
    assert refused.failed == 0
    assert refused.retry_after_ms == 600  # one request refills in 60/100 s
    assert refused.remaining == (0,)


async def test_refill_is_limit_over_sixty_per_second(limiter: Limiter, clock) -> None:
    bs = buckets(rpm=100)
    assert await admit_many(limiter, bs, 100) == 100
    clock.advance(30)  # half a minute: 50 requests' worth
    assert await admit_many(limiter, bs, 80) == 50


async def test_bucket_never_holds_more_than_its_capacity(limiter: Limiter, clock) -> None:
    bs = buckets(rpm=10)
    await admit_many(limiter, bs, 1)
    clock.advance(3600)  # an hour idle refills to the capacity, not beyond
    assert await admit_many(limiter, bs, 20) == 10


async def test_retry_after_is_exact(limiter: Limiter, clock) -> None:
    bs = buckets(tpm=6000)  # 100 tokens per second
    assert (await limiter.acquire(bs, [6000], "a", LEASE_US)).allowed
    refused = await limiter.acquire(bs, [3000], "b", LEASE_US)
    assert not refused.allowed
    assert refused.retry_after_ms == 30_000
    clock.advance(29)
    assert not (await limiter.acquire(bs, [3000], "c", LEASE_US)).allowed
    clock.advance(1)
    assert (await limiter.acquire(bs, [3000], "d", LEASE_US)).allowed


async def test_a_refused_request_charges_no_bucket(limiter: Limiter) -> None:
    roomy = buckets(rpm=100, concurrency=5, name="roomy", tag="refused")
    empty = buckets(tpm=10, name="empty", tag="refused")
    both = BucketSet(
        rate_keys=roomy.rate_keys + empty.rate_keys,
        rate_limits=roomy.rate_limits + empty.rate_limits,
        slot_keys=roomy.slot_keys,
        slot_limits=roomy.slot_limits,
    )
    refused = await limiter.acquire(both, [1, 11], "x", LEASE_US)
    assert not refused.allowed
    assert refused.failed == 1
    # The roomy buckets still hold everything: 100 requests and 5 free slots.
    after = await limiter.acquire(roomy, [100], "y", LEASE_US)
    assert after.allowed
    assert after.slots_in_use == (1,)


async def test_all_buckets_are_charged_when_admitted(limiter: Limiter) -> None:
    bs = buckets(rpm=10, tpm=1000)
    decision = await limiter.acquire(bs, [1, 400], "x", LEASE_US)
    assert decision.allowed
    assert decision.remaining == (9, 600)
    # reset: time until full again (1 request: 6 s; 400 tokens at 1000/min: 24 s)
    assert decision.reset_ms == (6_000, 24_000)


async def test_concurrency_slots_free_on_settle(limiter: Limiter) -> None:
    bs = buckets(concurrency=2)
    assert (await limiter.acquire(bs, [], "a", LEASE_US)).allowed
    assert (await limiter.acquire(bs, [], "b", LEASE_US)).allowed
    full = await limiter.acquire(bs, [], "c", LEASE_US)
    assert not full.allowed
    assert full.failed == 0
    assert full.slots_in_use == (2,)
    await limiter.settle(bs, [], [], "a")
    await limiter.settle(bs, [], [], "a")  # a second release frees nothing more
    assert (await limiter.acquire(bs, [], "c", LEASE_US)).allowed
    assert not (await limiter.acquire(bs, [], "d", LEASE_US)).allowed


async def test_a_slot_lease_expires(limiter: Limiter, clock) -> None:
    bs = buckets(concurrency=1)
    assert (await limiter.acquire(bs, [], "crashed", 10 * 1_000_000)).allowed
    assert not (await limiter.acquire(bs, [], "b", LEASE_US)).allowed
    clock.advance(11)  # the holder never released it; its lease ran out
    decision = await limiter.acquire(bs, [], "b", LEASE_US)
    assert decision.allowed
    assert decision.slots_in_use == (1,)


async def test_budget_refuses_once_spent_and_is_charged_at_settle(limiter: Limiter) -> None:
    bs = buckets(budget=100)
    first = await limiter.acquire(bs, [], "a", LEASE_US)
    assert first.allowed
    assert first.budget_used == (0,)
    await limiter.settle(bs, [], [60], "a")
    second = await limiter.acquire(bs, [], "b", LEASE_US)
    assert second.allowed  # 60 < 100: the budget is not spent yet
    await limiter.settle(bs, [], [45], "b")
    spent = await limiter.acquire(bs, [], "c", LEASE_US)
    assert not spent.allowed
    assert spent.failed == 0
    assert spent.budget_used == (105,)


async def test_a_budget_refuses_a_need_larger_than_what_is_left(limiter: Limiter) -> None:
    bs = buckets(rpm=10, budget=100)
    await limiter.acquire(bs, [1], "a", LEASE_US)
    await limiter.settle(bs, [0], [60], "a")  # 40 left
    refused = await limiter.acquire(bs, [1], "b", LEASE_US, needs=[41])
    assert not refused.allowed and refused.failed == 1  # the budget, after the rate bucket
    assert refused.remaining == (9,)  # nothing charged
    exact = await limiter.acquire(bs, [1], "c", LEASE_US, needs=[40])
    assert exact.allowed and exact.remaining == (8,)


async def test_unused_tokens_are_refunded(limiter: Limiter) -> None:
    bs = buckets(tpm=1000)
    assert (await limiter.acquire(bs, [600], "a", LEASE_US)).remaining == (400,)
    await limiter.settle(bs, [-500], [], "a")  # used 100 of the 600 reserved
    probe = await limiter.acquire(bs, [1], "b", LEASE_US)
    assert probe.remaining == (899,)


async def test_a_refund_never_fills_past_capacity(limiter: Limiter, clock) -> None:
    bs = buckets(tpm=1000)
    assert (await limiter.acquire(bs, [100], "a", LEASE_US)).allowed
    clock.advance(60)  # full again
    await limiter.settle(bs, [-100], [], "a")
    assert (await limiter.acquire(bs, [1000], "b", LEASE_US)).allowed
    assert not (await limiter.acquire(bs, [2], "c", LEASE_US)).allowed


async def test_usage_beyond_the_reservation_is_debt(limiter: Limiter, clock) -> None:
    bs = buckets(tpm=600)  # 10 tokens per second
    assert (await limiter.acquire(bs, [600], "a", LEASE_US)).allowed
    await limiter.settle(bs, [300], [], "a")  # used 300 more than reserved: level -300
    clock.advance(30)  # +300: back to 0
    refused = await limiter.acquire(bs, [10], "b", LEASE_US)
    assert not refused.allowed
    assert refused.retry_after_ms == 1000
    clock.advance(30)
    assert (await limiter.acquire(bs, [300], "c", LEASE_US)).allowed
    assert not (await limiter.acquire(bs, [2], "d", LEASE_US)).allowed


async def test_the_reason_reported_is_budget_then_slots_then_rate(limiter: Limiter) -> None:
    bs = buckets(rpm=1, concurrency=1, budget=10)
    assert (await limiter.acquire(bs, [1], "a", LEASE_US)).allowed
    # rate and slots both refuse: the slot set is reported (index 1)
    assert (await limiter.acquire(bs, [1], "b", LEASE_US)).failed == 1
    await limiter.settle(bs, [0], [10], "a")
    # now the budget is spent too: it is reported (index 2)
    assert (await limiter.acquire(bs, [1], "c", LEASE_US)).failed == 2


@pytest.mark.parametrize("limit", [1, 7, 60, 1000])
async def test_requests_admitted_over_a_window_never_exceed_capacity_plus_refill(
    limiter: Limiter, clock, limit: int
) -> None:
    bs = buckets(rpm=limit)
    admitted = 0
    start_us = clock()
    for _ in range(40):
        admitted += await admit_many(limiter, bs, 1 + limit // 10)
        window_s = (clock() - start_us) / 1e6
        assert admitted <= limit + limit * window_s / 60
        clock.advance(0.75)  # 30 s of jumps in all
    assert admitted >= limit  # and the whole burst was available
