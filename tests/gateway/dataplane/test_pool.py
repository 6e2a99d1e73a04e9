"""Pool: least outstanding, prefix affinity by rendezvous hashing, ejection and probing back."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from gateway.fleet.pool import Pool, Replica
from tests.gateway.dataplane.harness import free_port


def make_pool(n: int, slack: int = 2, base_url: str = "http://127.0.0.1:9") -> Pool:
    replicas = [Replica(f"r{i}", httpx.AsyncClient(base_url=base_url), up=True) for i in range(n)]
    return Pool("m", replicas, slack=slack, eject_after_failures=2, eject_cooldown_s=0.01)


def test_least_outstanding_wins_without_a_prefix() -> None:
    pool = make_pool(3)
    pool.replicas[0].outstanding = 4
    pool.replicas[1].outstanding = 1
    pool.replicas[2].outstanding = 3
    assert pool.pick(None) is pool.replicas[1]


def test_equal_load_spreads_over_replicas() -> None:
    pool = make_pool(3)
    picks = Counter(pool.pick(None).name for _ in range(30))  # type: ignore[union-attr]
    assert set(picks) == {"r0", "r1", "r2"}


def test_same_prefix_sticks_to_one_replica_and_prefixes_spread() -> None:
    pool = make_pool(4)
    for key in (b"system prompt A", b"system prompt B"):
        assert len({pool.pick(key).name for _ in range(10)}) == 1  # type: ignore[union-attr]
    owners = Counter(pool.pick(f"prompt {i}".encode()).name for i in range(200))  # type: ignore[union-attr]
    assert len(owners) == 4 and min(owners.values()) > 20


def test_affinity_yields_when_the_preferred_replica_is_overloaded() -> None:
    pool = make_pool(2, slack=2)
    preferred = pool.pick(b"shared prefix")
    other = next(r for r in pool.replicas if r is not preferred)
    preferred.outstanding = 2  # type: ignore[union-attr]
    assert pool.pick(b"shared prefix") is preferred  # within min + slack
    preferred.outstanding = 3  # type: ignore[union-attr]
    assert pool.pick(b"shared prefix") is other


def test_removing_a_replica_moves_only_its_keys() -> None:
    pool = make_pool(4)
    keys = [f"k{i}".encode() for i in range(200)]
    before = {k: pool.pick(k).name for k in keys}  # type: ignore[union-attr]
    pool.replicas[2].up = False
    after = {k: pool.pick(k).name for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r2" for k in moved)


def test_down_and_excluded_replicas_are_not_picked() -> None:
    pool = make_pool(2)
    pool.replicas[0].up = False
    assert pool.pick(b"x") is pool.replicas[1]
    assert pool.pick(b"x", exclude=(pool.replicas[1],)) is None


async def test_consecutive_failures_eject_and_a_failed_probe_keeps_it_out() -> None:
    pool = make_pool(2, base_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    bad = pool.replicas[0]
    pool.record_failure(bad)
    assert bad.available
    pool.record_success(bad)
    pool.record_failure(bad)
    assert bad.available  # success reset the count
    pool.record_failure(bad)
    assert not bad.available and pool.pick(None) is pool.replicas[1]
    bad.ejected_until = 0
    await pool.probe_ejected()
    assert bad.ejected and bad.ejected_until > 0


@pytest.mark.usefixtures("fake_remote")
async def test_probe_readmits_a_replica_that_answers(fake_remote: str) -> None:
    pool = make_pool(1, base_url=fake_remote)
    replica = pool.replicas[0]
    pool.eject(replica)
    assert pool.pick(None) is None
    replica.ejected_until = 0
    await pool.probe_ejected()
    assert replica.available and pool.pick(None) is replica


async def test_a_replica_without_a_probe_path_is_readmitted_half_open() -> None:
    pool = make_pool(1)
    replica = pool.replicas[0]
    replica.probe_path = None  # a remote endpoint: nothing to probe
    pool.record_failure(replica)
    pool.record_failure(replica)
    assert replica.ejected and pool.pick(None) is None
    replica.ejected_until = 0.0  # the cool-down is over
    await pool.probe_ejected()
    assert not replica.ejected and pool.pick(None) is replica
    pool.record_failure(replica)  # the next request was the probe, and it failed
    assert replica.ejected
    replica.ejected_until = 0.0
    await pool.probe_ejected()
    pool.record_success(replica)  # this time it answered: back to full standing
    pool.record_failure(replica)
    assert not replica.ejected
