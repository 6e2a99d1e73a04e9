"""The waiting-queue policies (engine/scheduling_policy.py) and the tenant tag they read
(engine/tenancy.py), on their own: order, counters, lift, the wait bound, holds, victims.

The scheduler-level behaviour (token splits, bounded waits, quotas) is proven in
test_scheduler_fairness.py; these tests pin the rules those results rest on.
"""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.request import Request
from engine.sampling_params import ParameterError, SamplingParams
from engine.scheduling_policy import FairPolicy, PriorityPolicy, SchedulingPolicy, make_policy
from portico.contract import (
    KV_SHARE_HEADER,
    MAX_RUNNING_HEADER,
    PRIORITY_CLASS_HEADER,
    TENANT_HEADER,
    WEIGHT_HEADER,
    TenantTag,
    tenant_from_headers,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, tenant: TenantTag | None = None, arrival: float = 0.0, priority: int = 0):
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(rid, [1, 2, 3], params, arrival_time=arrival, priority=priority, tenant=tenant)


def drain(policy: SchedulingPolicy) -> list[str]:
    """Pop everything in the policy's order (charging each pick 10 tokens, as admission would)."""
    order = []
    while (r := policy.peek()) is not None:
        policy.pop(r)
        policy.charge(r, 10)
        order.append(r.request_id)
    return order


BATCH = TenantTag("b", priority_class="batch")
INTERACTIVE = TenantTag("i")


def test_fcfs_is_arrival_order_whatever_the_priority_or_class() -> None:
    policy = make_policy("fcfs", FakeClock())
    policy.add(req("late", INTERACTIVE, arrival=3.0, priority=-5))
    policy.add(req("first", BATCH, arrival=1.0, priority=9))
    policy.add(req("second", TenantTag("x"), arrival=2.0))
    assert drain(policy) == ["first", "second", "late"]


def test_priority_is_class_then_priority_then_arrival() -> None:
    policy = make_policy("priority", FakeClock())
    policy.add(req("batch-urgent", BATCH, arrival=0.0, priority=-9))
    policy.add(req("later", INTERACTIVE, arrival=2.0, priority=0))
    policy.add(req("earlier", INTERACTIVE, arrival=1.0, priority=0))
    policy.add(req("urgent", INTERACTIVE, arrival=3.0, priority=-1))
    assert drain(policy) == ["urgent", "earlier", "later", "batch-urgent"]


def test_fair_alternates_between_equal_tenants_and_keeps_each_tenants_own_order() -> None:
    policy = make_policy("fair", FakeClock())
    a, b = TenantTag("a"), TenantTag("b")
    for i in range(3):
        policy.add(req(f"a{i}", a, arrival=i))
    for i in range(3):
        policy.add(req(f"b{i}", b, arrival=10 + i))
    assert drain(policy) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_fair_counters_divide_tokens_by_weight() -> None:
    policy = FairPolicy(FakeClock())
    heavy = TenantTag("heavy", weight=4.0)
    policy.charge(req("x", heavy), 100)
    policy.charge(req("y", TenantTag("light")), 100)
    assert policy.counters == {"heavy": 25.0, "light": 100.0}


def test_fair_weight_three_gets_three_picks_per_pick_of_weight_one() -> None:
    policy = make_policy("fair", FakeClock())
    one, three = TenantTag("one"), TenantTag("three", weight=3.0)
    for i in range(40):
        policy.add(req(f"one{i}", one, arrival=i))
        policy.add(req(f"three{i}", three, arrival=i))
    picks = drain(policy)[:40]
    assert sum(p.startswith("three") for p in picks) == 30


def test_an_idle_tenant_is_lifted_and_banks_no_credit() -> None:
    policy = FairPolicy(FakeClock())
    busy, idle = TenantTag("busy"), TenantTag("idle")
    for i in range(20):
        policy.add(req(f"busy{i}", busy, arrival=i))
    assert drain_n(policy, 10) == [f"busy{i}" for i in range(10)]  # 100 tokens served
    for i in range(3):
        policy.add(req(f"idle{i}", idle, arrival=100 + i))
    assert policy.counters["idle"] == policy.counters["busy"] == 100.0
    # Without the lift, idle would take its 3 requests back to back; with it they alternate.
    assert drain_n(policy, 4) == ["busy10", "idle0", "busy11", "idle1"]


def drain_n(policy: SchedulingPolicy, n: int) -> list[str]:
    out = []
    for _ in range(n):
        r = policy.peek()
        assert r is not None
        policy.pop(r)
        policy.charge(r, 10)
        out.append(r.request_id)
    return out


def test_a_tenant_returning_to_an_empty_queue_is_lifted_to_the_last_drained_counter() -> None:
    policy = FairPolicy(FakeClock())
    a, b = TenantTag("a"), TenantTag("b")
    policy.add(req("a0", a))
    drain(policy)  # a's counter 10, and a's queue emptied there
    policy.add(req("b0", b))
    assert policy.counters["b"] == 10.0


def test_fair_serves_interactive_flows_before_batch_ones_whatever_the_counters() -> None:
    policy = FairPolicy(FakeClock())
    policy.charge(req("x", INTERACTIVE), 1000)  # interactive already served a lot
    policy.add(req("batch", BATCH, arrival=0.0))
    policy.add(req("chat", INTERACTIVE, arrival=5.0))
    assert drain(policy) == ["chat", "batch"]


def test_the_wait_bound_puts_the_oldest_overdue_request_first() -> None:
    clock = FakeClock()
    policy = make_policy("fair", clock, max_wait_s=5.0)
    policy.add(req("batch", BATCH, arrival=0.0))
    clock.now = 1.0
    policy.add(req("chat0", INTERACTIVE, arrival=1.0))
    policy.add(req("chat1", INTERACTIVE, arrival=1.0))
    assert policy.peek().request_id == "chat0"
    clock.now = 5.0  # batch has waited 5 s: it goes first, class and counters aside
    assert drain(policy) == ["batch", "chat0", "chat1"]


def test_the_wait_bound_is_fair_only_and_off_when_infinite() -> None:
    clock = FakeClock()
    assert make_policy("priority", clock, max_wait_s=1.0).max_wait_s is None
    assert make_policy("fair", clock, max_wait_s=math.inf).max_wait_s is None
    with pytest.raises(ValueError, match="--scheduling-policy"):
        make_policy("lottery", clock)


def test_hold_skips_a_request_for_the_step_and_keeps_its_place() -> None:
    policy = make_policy("fair", FakeClock())
    a = TenantTag("a")
    for i in range(3):
        policy.add(req(f"a{i}", a, arrival=i))
    first = policy.peek()
    policy.hold(first)
    assert policy.peek().request_id == "a1" and len(policy) == 3
    policy.release_holds()
    assert drain(policy) == ["a0", "a1", "a2"]


def test_a_hold_is_not_an_arrival_so_it_lifts_no_counter() -> None:
    policy = FairPolicy(FakeClock())
    a, b = TenantTag("a"), TenantTag("b")
    policy.add(req("b0", b))
    policy.add(req("a0", a))
    policy.charge(req("x", b), 50)
    policy.hold(policy.peek())  # a0 (counter 0) cannot run this step
    policy.release_holds()
    assert policy.counters["a"] == 0.0


def test_hold_tenant_skips_all_its_requests_until_released() -> None:
    policy = make_policy("fair", FakeClock())
    a, b = TenantTag("a"), TenantTag("b")
    policy.add(req("a0", a, arrival=0))
    policy.add(req("a1", a, arrival=1))
    policy.add(req("b0", b, arrival=2))
    policy.hold_tenant("a")
    assert policy.peek().request_id == "b0"
    policy.pop(policy.peek())
    assert policy.peek() is None
    policy.release_holds()
    assert policy.peek().request_id == "a0"


def test_pop_of_a_waiting_request_removes_it_and_keeps_the_counts() -> None:
    policy = make_policy("fair", FakeClock())
    rs = [req(f"r{i}", TenantTag("t"), arrival=i) for i in range(3)]
    for r in rs:
        policy.add(r)
    policy.forget(rs[1])  # aborted while waiting
    assert policy.num_waiting_by_tenant == {"t": 2}
    assert sorted(r.request_id for r in policy) == ["r0", "r2"]
    assert drain(policy) == ["r0", "r2"]
    assert policy.num_waiting_by_tenant == {} and len(policy) == 0


def test_a_readded_request_keeps_its_original_place() -> None:
    policy = PriorityPolicy(FakeClock())
    old, new = req("old", arrival=1.0), req("new", arrival=2.0)
    policy.add(old)
    policy.add(new)
    policy.pop(policy.peek())
    policy.add(old)  # preempted: back ahead of later arrivals
    assert drain(policy) == ["old", "new"]


def test_fair_victim_is_the_most_served_tenants_newest_and_batch_before_interactive() -> None:
    policy = FairPolicy(FakeClock())
    heavy, light = TenantTag("heavy"), TenantTag("light")
    running = [req("h0", heavy, 0), req("h1", heavy, 1), req("l0", light, 2)]
    for r in running:
        policy.add(r)
        policy.pop(r)
    policy.charge(running[0], 100)

    def never(tag: TenantTag) -> bool:
        return False

    assert policy.choose_victim(running, never).request_id == "h1"
    assert policy.choose_victim(running, lambda t: t.name == "light").request_id == "l0"
    bulk = req("bulk", TenantTag("bulk", priority_class="batch"), 3)
    policy.add(bulk)
    policy.pop(bulk)
    assert policy.choose_victim([*running, bulk], never) is bulk


def test_fcfs_victim_is_the_last_running() -> None:
    policy = make_policy("fcfs", FakeClock())
    running = [req("a", arrival=0), req("b", arrival=1)]
    assert policy.choose_victim(running, lambda t: True) is running[-1]


# -- the tenant tag ------------------------------------------------------------------------


def test_absent_headers_give_the_default_tenant() -> None:
    assert tenant_from_headers({}) == TenantTag("default", 1.0, "interactive", 1.0)


def test_headers_map_to_the_tag() -> None:
    tag = tenant_from_headers(
        {
            TENANT_HEADER: "acme",
            WEIGHT_HEADER: "2.5",
            PRIORITY_CLASS_HEADER: "batch",
            KV_SHARE_HEADER: "0.25",
            MAX_RUNNING_HEADER: "3",
        }
    )
    assert tag == TenantTag("acme", 2.5, "batch", 0.25, 3) and tag.class_rank == 1


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (TENANT_HEADER, ""),
        (TENANT_HEADER, "x" * 201),
        (TENANT_HEADER, "a\nb"),
        (WEIGHT_HEADER, "0"),
        (WEIGHT_HEADER, "-1"),
        (WEIGHT_HEADER, "heavy"),
        (WEIGHT_HEADER, "nan"),
        (MAX_RUNNING_HEADER, "-1"),
        (MAX_RUNNING_HEADER, "1.5"),
        (MAX_RUNNING_HEADER, "many"),
        (MAX_RUNNING_HEADER, "²"),
        (MAX_RUNNING_HEADER, "10000001"),
        (WEIGHT_HEADER, "inf"),
        (KV_SHARE_HEADER, "0"),
        (KV_SHARE_HEADER, "1.5"),
        (PRIORITY_CLASS_HEADER, "urgent"),
    ],
)
def test_bad_header_values_raise_naming_the_header(header: str, value: str) -> None:
    with pytest.raises(ParameterError) as info:
        tenant_from_headers({header: value})
    assert info.value.param == header


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    policy_name=st.sampled_from(["fcfs", "priority", "fair"]),
    max_wait_s=st.sampled_from([math.inf, 4.0]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "admit", "hold", "hold_tenant", "release", "abort", "tick"]),
            st.integers(0, 3),  # tenant
            st.integers(0, 2),  # priority
            st.booleans(),  # batch class
        ),
        max_size=80,
    ),
)
def test_peek_is_always_the_brute_force_minimum(
    policy_name: str, max_wait_s: float, ops: list[tuple[str, int, int, bool]]
) -> None:
    """Whatever the sequence of operations, peek() returns what a scan of every waiting,
    not-held request by the policy's rule would return, and the counts stay exact."""
    clock = FakeClock()
    policy = make_policy(policy_name, clock, max_wait_s)
    if policy_name != "fair":
        max_wait_s = math.inf  # the wait bound is fair's only
    waiting: dict[str, Request] = {}
    entered: dict[str, float] = {}
    held: set[str] = set()
    held_tenants: set[str] = set()
    for i, (op, t, priority, batch) in enumerate(ops):
        if op == "add":
            tag = TenantTag(
                f"t{t}", weight=1.0 + t, priority_class="batch" if batch else "interactive"
            )
            r = req(f"r{i}", tag, arrival=clock.now, priority=priority)
            policy.add(r)
            waiting[r.request_id], entered[r.request_id] = r, clock.now
        elif op == "tick":
            clock.now += 1.0
        elif op == "release":
            policy.release_holds()
            held.clear()
            held_tenants.clear()
        elif op == "hold_tenant":
            policy.hold_tenant(f"t{t}")
            held_tenants.add(f"t{t}")
        elif op == "abort" and waiting:
            victim = sorted(waiting)[t % len(waiting)]
            if victim not in held:
                policy.forget(waiting.pop(victim))
        else:  # admit or hold the head, as the scheduler does
            head = policy.peek()
            if head is None:
                continue
            if op == "hold":
                policy.hold(head)
                held.add(head.request_id)
            else:
                policy.pop(head)
                policy.charge(head, 5 + priority)
                del waiting[head.request_id]
        candidates = [
            r for rid, r in waiting.items() if rid not in held and r.tenant.name not in held_tenants
        ]
        expected = None
        if candidates:
            overdue = [
                r
                for r in waiting.values()
                if r.request_id not in held and clock.now - entered[r.request_id] >= max_wait_s
            ]
            first = min(
                overdue, key=lambda r: (entered[r.request_id], policy.key_of(r)), default=None
            )
            if first is not None and first.tenant.name not in held_tenants:
                expected = first
            elif policy_name == "fair":
                counters = policy.counters  # type: ignore[attr-defined]
                expected = min(
                    candidates,
                    key=lambda r: (
                        policy.key_of(r)[0],
                        counters.get(r.tenant.name, 0.0),
                        *policy.key_of(r)[1:],
                    ),
                )
            else:
                expected = min(candidates, key=policy.key_of)
        assert policy.peek() is expected
        assert len(policy) == len(waiting)
        by_tenant: dict[str, int] = {}
        for rid, r in waiting.items():
            if rid not in held:
                by_tenant[r.tenant.name] = by_tenant.get(r.tenant.name, 0) + 1
        assert policy.num_waiting_by_tenant == by_tenant


def test_the_engine_flags_choose_the_policy_and_its_wait_bound() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    default = EngineConfig.from_cli_args(parser.parse_args([]))
    assert (default.scheduling_policy, default.fair_max_wait_s) == ("fair", 30.0)
    args = parser.parse_args(["--scheduling-policy", "priority", "--fair-max-wait-s", "5"])
    config = EngineConfig.from_cli_args(args)
    assert (config.scheduling_policy, config.fair_max_wait_s) == ("priority", 5.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lottery"])
    with pytest.raises(ValueError, match="--scheduling-policy"):
        EngineConfig(scheduling_policy="lottery")
    with pytest.raises(ValueError, match="--fair-max-wait-s"):
        EngineConfig(fair_max_wait_s=-1.0)


def test_the_engine_flags_set_the_contended_step_cap_and_its_window() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    default = EngineConfig.from_cli_args(parser.parse_args([]))
    assert (default.fair_contended_prefill_tokens, default.fair_contention_window_s) == (192, 300.0)
    assert (default.fair_batch_prefill_tokens, default.fair_batch_window_s) == (64, 2.0)
    assert EngineConfig.from_cli_args(parser.parse_args(["--fair-batch-window-s", "7"])) == (
        EngineConfig(fair_batch_window_s=7.0)
    )
    args = parser.parse_args(
        ["--fair-contended-prefill-tokens", "0", "--fair-contention-window-s", "0.5"]
    )
    config = EngineConfig.from_cli_args(args)
    assert (config.fair_contended_prefill_tokens, config.fair_contention_window_s) == (0, 0.5)
    with pytest.raises(ValueError, match="--fair-contended-prefill-tokens"):
        EngineConfig(fair_contended_prefill_tokens=-1)
    with pytest.raises(ValueError, match="--fair-contended-prefill-tokens"):
        EngineConfig(fair_contended_prefill_tokens=True)
    with pytest.raises(ValueError, match="--fair-contention-window-s"):
        EngineConfig(fair_contention_window_s=float("nan"))
    with pytest.raises(ValueError, match="--fair-batch-window-s"):
        EngineConfig(fair_batch_window_s=-1.0)


def test_the_engine_flag_sets_the_short_prefill_limit() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).fair_short_prefill_tokens == 256
    args = parser.parse_args(["--fair-short-prefill-tokens", "0"])
    assert EngineConfig.from_cli_args(args).fair_short_prefill_tokens == 0
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="--fair-short-prefill-tokens"):
            EngineConfig(fair_short_prefill_tokens=bad)
    assert EngineConfig.from_cli_args(parser.parse_args([])).fair_batch_prefill_tokens == 64
    args = parser.parse_args(["--fair-batch-prefill-tokens", "0"])
    assert EngineConfig.from_cli_args(args).fair_batch_prefill_tokens == 0
    with pytest.raises(ValueError, match="--fair-batch-prefill-tokens"):
        EngineConfig(fair_batch_prefill_tokens=-3)
