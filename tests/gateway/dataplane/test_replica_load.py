"""A replica's live load (gateway/dataplane/replica_load.py): leases give back exactly what they
took, and the expected wait follows the engine's fair scheduler."""

from __future__ import annotations

import asyncio
import random

from gateway.dataplane.replica_load import (
    PREFILL_CHUNK_TOKENS,
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


def test_an_idle_tenant_waits_one_chunk_of_other_tenants_prefill_not_all_of_it() -> None:
    """The fair policy lifts a tenant with nothing waiting to the least counter: it shares the
    next step with one chunk of the others' prefill."""
    load = ReplicaLoad()
    load.lease(2000, "other")
    idle = estimate_wait(load, "t", 20)
    assert idle == PREFILL_CHUNK_TOKENS + 20 + 2 * STEP_OVERHEAD_TOKENS
    load.lease(600, "t")  # the tenant's own prefill pending there: behind it and the others
    busy = estimate_wait(load, "t", 20)
    assert busy == 2620 + 11 * STEP_OVERHEAD_TOKENS
    # with no tenant (no principal) every such request is one flow: all ahead
    load.lease(100, None)
    assert estimate_wait(load, None, 20) == 2720 + 11 * STEP_OVERHEAD_TOKENS


def test_decode_rows_weigh_on_every_step_and_others_queued_count_as_ahead() -> None:
    load = ReplicaLoad()
    for _ in range(4):
        load.lease(20, "x").first_token()
    assert estimate_wait(load, "t", 600) == 600 + 3 * (STEP_OVERHEAD_TOKENS + 4)
    # the engine reports more rows than ours (another gateway's): the larger count
    assert estimate_wait(load, "t", 600, num_decoding=9) == 600 + 3 * (STEP_OVERHEAD_TOKENS + 9)
    assert estimate_wait(load, "t", 600, num_decoding=1) == 600 + 3 * (STEP_OVERHEAD_TOKENS + 4)
    # requests queued by others (tenants unknown) are ahead, not lifted past
    assert estimate_wait(load, "t", 20, foreign_prefill=1000) == 1020 + 4 * (
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
