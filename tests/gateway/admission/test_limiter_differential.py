"""Redis (limiter.lua) and the local limiter agree on every decision, for any sequence of
admissions, settlements and clock jumps (hypothesis picks the sequences).

Both run on one fake clock that moves only when the sequence says (see conftest.FakeClock):
every difference would be one of arithmetic, not of timing.
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.limiter import BucketSet, LocalLimiter, RedisLimiter

_run_ids = itertools.count()
SLOT_IDS = ("a", "b", "c")
LEASES_US = (1_000_000, 10_000_000, 600_000_000)


def bucket_sets(run: int, rpm: int, tpm: int, slots: int, budget: int) -> list[BucketSet]:
    base = f"portico:diff:{{{run}}}"
    full = BucketSet(
        rate_keys=(f"{base}:rpm", f"{base}:tpm"),
        rate_limits=(rpm, tpm),
        slot_keys=(f"{base}:conc",),
        slot_limits=(slots,),
        budget_keys=(f"{base}:budget",),
        budget_limits=(budget,),
    )
    tokens_only = BucketSet(rate_keys=(f"{base}:tpm",), rate_limits=(tpm,))
    return [full, tokens_only]


acquire = st.tuples(
    st.just("acquire"),
    st.integers(0, 1),
    st.integers(0, 3),  # requests cost
    st.integers(0, 1500),  # tokens cost
    st.sampled_from(SLOT_IDS),
    st.sampled_from(LEASES_US),
)
settle = st.tuples(
    st.just("settle"),
    st.integers(0, 1),
    st.integers(-1500, 1500),  # tokens delta
    st.integers(0, 800),  # budget charge
    st.sampled_from(SLOT_IDS),
    st.just(0),
)
advance = st.tuples(
    st.just("advance"), st.just(0), st.integers(0, 90_000_000), st.just(0), st.just(""), st.just(0)
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    limits=st.tuples(
        st.integers(1, 120), st.integers(1, 2000), st.integers(1, 3), st.integers(0, 3000)
    ),
    ops=st.lists(st.one_of(acquire, settle, advance), min_size=1, max_size=30),
)
def test_redis_and_local_limiters_decide_alike(
    redis_url: str, redis_client_factory, clock_factory, limits, ops
) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(run_both(redis_client_factory(redis_url), clock_factory(), limits, ops))


async def run_both(client, clock, limits, ops) -> None:  # type: ignore[no-untyped-def]
    shared = RedisLimiter(client, clock=clock)
    local = LocalLimiter(clock=clock)
    sets = bucket_sets(next(_run_ids), *limits)
    try:
        for step, (kind, which, a, b, slot_id, lease) in enumerate(ops):
            bs = sets[which]
            if kind == "advance":
                clock.advance(a / 1e6)
            elif kind == "acquire":
                costs = [a, b] if len(bs.rate_keys) == 2 else [b]
                got = await shared.acquire(bs, costs, slot_id, lease)
                want = await local.acquire(bs, costs, slot_id, lease)
                assert got == want, f"step {step}: {ops[step]}"
            else:
                deltas = [0, a] if len(bs.rate_keys) == 2 else [a]
                charges = [b] * len(bs.budget_keys)
                await shared.settle(bs, deltas, charges, slot_id)
                await local.settle(bs, deltas, charges, slot_id)
    finally:
        await client.aclose()
