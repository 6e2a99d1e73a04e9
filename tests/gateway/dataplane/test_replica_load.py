"""A replica's live load (gateway/fleet/replica_load.py): leases give back exactly what they
took, and the expected wait follows the engine's fair scheduler."""

from __future__ import annotations

import asyncio
import random

from gateway.fleet.replica_load import (
    SHORT_PREFILL_TOKENS,
    STEP_OVERHEAD_TOKENS,
    ReplicaLoad,
    estimate_wait,
)


def test_a_lease_moves_from_prefill_to_decode_and_gives_back_everything() -> None:
    load = ReplicaLoad()
    a = load.lease(600, "t1")
    b = load.lease(20, "t1")
    c = load.lease(300, "t2")
    assert (load.outstanding, load.pending_prefill, load.num_prefilling) == (3, 920, 3)
    assert load.tenant_prefill == {"t1": 620, "t2": 300}
    a.first_token()
    a.first_token()  # a second first token changes nothing
    assert (load.pending_prefill, load.num_prefilling, load.num_decoding) == (320, 2, 1)
    assert load.tenant_prefill == {"t1": 20, "t2": 300}
    c.release()  # closed before its first token (an error, a client gone): its prefill goes
    c.release()
    c.first_token()  # too late: released
    assert load.tenant_prefill == {"t1": 20}
    a.release()
    b.first_token()
    b.release()
    assert load == ReplicaLoad()


def test_random_lease_lifetimes_always_return_to_an_empty_load() -> None:
    rng = random.Random(7)
    for _ in range(50):
        load = ReplicaLoad()
        leases = [load.lease(rng.randrange(0, 900), rng.choice(["a", "b", None])) for _ in range(8)]
        for _ in range(30):
            lease = rng.choice(leases)
            if rng.random() < 0.5:
                lease.first_token()
            else:
                lease.release()
            assert load.pending_prefill == sum(
                x.prefill_tokens for x in leases if not x.prefilled and not x.released
            )
            assert load.pending_prefill >= 0 and load.num_decoding >= 0
        for lease in leases:
            lease.release()
        assert load == ReplicaLoad()


def test_a_newcomers_short_prompt_runs_in_a_step_of_its_own() -> None:
    """A tenant with nothing pending whose prompt fits the engine's short-prefill budget gets a
    step beside the decodes only (FairPolicy.short_step): no other tenant's prefill is ahead
    of it, however much there is; the decodes still weigh on that step."""
    load = ReplicaLoad()
    load.lease(2000, "other")
    assert estimate_wait(load, "t", 20) == 20 + STEP_OVERHEAD_TOKENS
    # 256 tokens: a step of its own, in two capped chunks (192 + 64)
    assert estimate_wait(load, "t", SHORT_PREFILL_TOKENS) == 256 + 2 * STEP_OVERHEAD_TOKENS
    load.lease(0, "x").first_token()
    load.lease(0, "x").first_token()
    assert estimate_wait(load, "t", 20) == 20 + (STEP_OVERHEAD_TOKENS + 2)


def test_a_newcomers_long_prompt_shares_each_step_with_every_other_tenant() -> None:
    """Past the short-prefill budget it shares the steps (processor sharing): each other
    tenant's pending prefill runs beside it up to its own need, requests without a tenant
    as one flow."""
    load = ReplicaLoad()
    load.lease(2000, "u")
    load.lease(300, "v")
    load.lease(60, None)
    load.lease(40, None)
    need = 830
    ahead = need + 300 + 100  # min(2000, 830) + min(300, 830) + min(100, 830)
    # 2,060 tokens in ceil(2,060 / 192) = 11 steps
    assert estimate_wait(load, "t", need) == ahead + need + 11 * STEP_OVERHEAD_TOKENS


def test_a_tenant_with_prefill_pending_waits_for_at_most_its_need_of_each_other_tenant() -> None:
    """Its own pending prefill is ahead of it (FCFS within a tenant), and each other tenant
    shares the steps until its need is met: a long queue of another tenant's is not all
    ahead. Requests without a tenant are a flow like any other."""
    load = ReplicaLoad()
    load.lease(2000, "other")
    load.lease(600, "t")
    need = 600 + 20
    assert estimate_wait(load, "t", 20) == need + need + 7 * STEP_OVERHEAD_TOKENS  # 1,240
    load.lease(100, None)
    need = 100 + 20  # None's own, then min(2000, 120) + min(600, 120) of the others
    assert estimate_wait(load, None, 20) == need + 2 * need + 2 * STEP_OVERHEAD_TOKENS


def test_own_and_another_tenants_equal_pending_weigh_the_same_for_a_long_prompt() -> None:
    """Symmetric: 600 tokens of the tenant's own pending ahead of its 700, or another tenant's
    600 sharing the steps with its 700, both leave the first token after 1,300 tokens."""
    own = ReplicaLoad()
    own.lease(600, "t")
    another = ReplicaLoad()
    another.lease(600, "u")
    assert estimate_wait(own, "t", 700) == estimate_wait(another, "t", 700)
    assert estimate_wait(own, "t", 700) == 1300 + 7 * STEP_OVERHEAD_TOKENS
    # and the other tenant, asking the same of each, sees the mirror image
    assert estimate_wait(own, "u", 700) == estimate_wait(another, "u", 700)


def test_the_opening_burst_worked_through() -> None:
    """The fleet bench's opening burst (~830-token prompts, no decodes yet): tenant A's second
    question (20 tokens past its system prompt, which its first, still prefilling on R1,
    is computing) on R1, against a spill to R2, which recomputes 810 more tokens (the pool
    adds them to R2's score, gateway/fleet/pool.py)."""
    r1 = ReplicaLoad()
    for tenant in ("A", "B", "C"):
        r1.lease(830, tenant)
    # need = 830 + 20; B's and C's 830 each run beside it: 2,510 tokens in 14 steps of 192
    assert estimate_wait(r1, "A", 20) == 2510 + 14 * STEP_OVERHEAD_TOKENS  # 2,650
    spill = 830 - 20
    r2 = ReplicaLoad()
    r2.lease(830, "D")
    r2.lease(830, "E")
    # two other tenants pending on R2 too: 830 + 1,660 in 13 steps, 2,620 + 810: stays on R1
    # (when they counted as one chunk, R2 looked cheaper, and it spilled)
    assert estimate_wait(r2, "A", 830) + spill == 2490 + 13 * STEP_OVERHEAD_TOKENS + spill
    assert estimate_wait(r2, "A", 830) + spill > estimate_wait(r1, "A", 20)
    # one other tenant on R2: 1,660 in 9 steps, 1,750 + 810 = 2,560 against 2,650: a spill, by
    # the step overheads. Processor sharing: R2's first token after 1,660 tokens, R1's after
    # 2,510, the difference about the recomputation; a tie, not the estimate's fault.
    r2 = ReplicaLoad()
    r2.lease(830, "D")
    assert estimate_wait(r2, "A", 830) + spill == 1660 + 9 * STEP_OVERHEAD_TOKENS + spill
    assert estimate_wait(r2, "A", 830) + spill < estimate_wait(r1, "A", 20)
    # What keeps R1 from collecting three tenants against R2's one: C's cold first prompt saw
    # A's and B's on R1 as one chunk, as it saw D's on R2 (a tie); now twice D's.
    two = ReplicaLoad()
    two.lease(830, "A")
    two.lease(830, "B")
    assert estimate_wait(two, "C", 830) == 2490 + 13 * STEP_OVERHEAD_TOKENS
    assert estimate_wait(r2, "C", 830) == 1660 + 9 * STEP_OVERHEAD_TOKENS


def test_decode_rows_weigh_on_every_step_and_others_queued_count_as_ahead() -> None:
    load = ReplicaLoad()
    for _ in range(4):
        load.lease(20, "x").first_token()
    assert estimate_wait(load, "t", 600) == 600 + 4 * (STEP_OVERHEAD_TOKENS + 4)
    # the engine reports more rows than ours (another gateway's): the larger count
    assert estimate_wait(load, "t", 600, num_decoding=9) == 600 + 4 * (STEP_OVERHEAD_TOKENS + 9)
    assert estimate_wait(load, "t", 600, num_decoding=1) == 600 + 4 * (STEP_OVERHEAD_TOKENS + 4)
    # requests queued by others (tenants unknown) are ahead, not lifted past
    assert estimate_wait(load, "t", 20, foreign_prefill=1000) == 1020 + 6 * (
        STEP_OVERHEAD_TOKENS + 4
    )


async def test_a_follower_waits_for_its_leaders_first_token_or_end_or_the_bound() -> None:
    load = ReplicaLoad()
    leader = load.lease(400, "t", blocks=(b"a", b"b"))
    follower = load.lease(20, "t", blocks=(b"c",), follows=leader)
    assert load.computing == {b"a": leader, b"b": leader, b"c": follower}
    waiting = asyncio.create_task(leader.wait_prefilled(60.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    leader.first_token()  # its blocks are computed (the engine stores them): not "computing"
    await waiting
    assert load.computing == {b"c": follower}
    await leader.wait_prefilled(60.0)  # already past: returns at once
    failed = load.lease(400, "u", blocks=(b"d",))
    waiting = asyncio.create_task(failed.wait_prefilled(60.0))
    await asyncio.sleep(0)
    failed.release()  # an attempt that failed: its followers go on (and compute it themselves)
    await waiting
    stuck = load.lease(400, "v", blocks=(b"e",))
    await stuck.wait_prefilled(0.01)  # bounded: returns with the leader still prefilling
    assert not stuck.prefilled and load.computing[b"e"] is stuck
