"""Tenants inside the scheduler, continued from test_scheduler_fairness.py: preemption victims,
KV quotas and per-tenant stats, random multi-tenant traffic checked against a plain loop, and
greedy outputs of the real tiny engine under every policy.

Waits are counted in scheduler steps: nothing here depends on wall time or thread count.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.model_loader import LoadedModel
from engine.request import Request, RequestStatus
from engine.sampling_params import ParameterError, SamplingParams
from engine.scheduler import Scheduler
from engine.tenancy import TenantTag
from tests.engine.test_scheduler import (
    VOCAB,
    PagedTokenModel,
    assert_no_leaks,
    reference_output,
    step,
)
from tests.engine.test_scheduler_fairness import (
    FakeClock,
    make,
    submit,
)
from tests.engine.tiny_engine import make_engine, run_all

# -- preemption ----------------------------------------------------------------------------


def first_victims(policy: str) -> list[str]:
    """Heavy runs two requests, light one (the newest); the pool runs out as they decode.
    Returns who was preempted in the first step that preempted (index: 0, 1 heavy; 2 light)."""
    sched, model = make(policy, num_blocks=8)
    heavy, light = TenantTag("heavy"), TenantTag("light")
    reqs = [
        submit(sched, heavy, prompt_len=8, max_tokens=12, arrival_time=1.0),
        submit(sched, heavy, prompt_len=8, max_tokens=12, arrival_time=2.0),
        submit(sched, light, prompt_len=4, max_tokens=12, arrival_time=3.0),
    ]
    names = dict(
        zip((r.request_id for r in reqs), ("heavy-old", "heavy-new", "light"), strict=True)
    )
    victims: list[str] = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        if out.num_preempted and not victims:
            victims = [names[r.request_id] for r in reqs if r.num_preemptions]
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 12)
    assert_no_leaks(sched)
    return victims


def test_preemption_takes_the_over_served_tenants_newest_not_the_newest_overall() -> None:
    assert first_victims("fair") == ["heavy-new"]
    assert first_victims("fcfs") == ["light"]  # fcfs: the newest, whoever it belongs to


def test_a_victim_planned_earlier_in_the_step_gives_its_tokens_back() -> None:
    sched, model = make("fair", num_blocks=8)
    heavy, light = TenantTag("heavy"), TenantTag("light")
    h = submit(sched, heavy, prompt_len=8, max_tokens=12, arrival_time=1.0)
    h2 = submit(sched, heavy, prompt_len=8, max_tokens=12, arrival_time=2.0)
    submit(sched, light, prompt_len=4, max_tokens=12, arrival_time=3.0)
    while not h2.num_preemptions:
        out, _ = step(sched, model)
    # h2 ran before light in the running order, yet it was the one taken off this step.
    assert h2.request_id not in {r.request_id for r, _ in out.scheduled}
    assert all(r.status == RequestStatus.RUNNING for r, _ in out.scheduled)
    assert h.status == RequestStatus.RUNNING


# -- KV quota ------------------------------------------------------------------------------


def test_a_tenant_at_its_kv_share_waits_while_another_proceeds() -> None:
    sched, model = make("fair", num_blocks=32)
    capped = TenantTag("capped", kv_share=0.25)  # 8 of 32 blocks
    first = submit(sched, capped, prompt_len=20, arrival_time=0.0)  # 5 blocks
    second = submit(sched, capped, prompt_len=20, arrival_time=1.0)  # 5 more: over 8
    other = submit(sched, TenantTag("other"), prompt_len=20, arrival_time=2.0)
    step(sched, model)
    assert first.status == RequestStatus.RUNNING and other.status == RequestStatus.RUNNING
    assert second.status == RequestStatus.WAITING
    assert sched.kv.num_tenant_blocks("capped") == 5  # its 20 prompt tokens
    stats = {t.name: t for t in sched.stats.tenants}
    assert stats["capped"].num_waiting == 1 and stats["capped"].num_kv_blocks == 5
    while first.status == RequestStatus.RUNNING:
        step(sched, model)
    step(sched, model)
    assert second.status == RequestStatus.RUNNING  # its turn once the first one left
    while sched.has_unfinished():
        step(sched, model)
    assert_no_leaks(sched)


def test_a_tiny_share_still_runs_one_request_at_a_time() -> None:
    sched, model = make("fair", num_blocks=32)
    tiny = TenantTag("tiny", kv_share=0.01)  # less than one block
    reqs = [submit(sched, tiny, prompt_len=12) for _ in range(3)]
    most_running = 0
    while sched.has_unfinished():
        step(sched, model)
        most_running = max(most_running, len(sched.running))
    assert most_running == 1
    for r in reqs:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 8)


def test_shared_prefix_blocks_are_charged_to_each_tenant_holding_them_once() -> None:
    sched, model = make("fair", num_blocks=64, max_num_batched_tokens=64)
    prompt = list(range(1, 17))  # 4 full blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = Request("a0", prompt, params, tenant=TenantTag("a"))
    sched.add_request(a)
    step(sched, model)  # a0's prompt is computed and cached
    sched.add_request(Request("a1", prompt, params, tenant=TenantTag("a")))
    sched.add_request(Request("b0", prompt, params, tenant=TenantTag("b")))
    step(sched, model)
    # a0 holds 5 blocks (its prompt's 4 + a decode slot). a1 hits 3 of them (a lookup never
    # covers the last token) and computes its last block anew: a counts 5 + 1 distinct
    # blocks. b0 holds the same 3 shared ones and its own last: 4.
    assert sched.kv.num_tenant_blocks("a") == 6
    assert sched.kv.num_tenant_blocks("b") == 4
    while sched.has_unfinished():
        step(sched, model)
    assert sched.kv.tenant_blocks() == {}
    assert_no_leaks(sched)


# -- stats ---------------------------------------------------------------------------------


def test_tenant_stats_count_tokens_as_scheduled() -> None:
    sched, model = make("fair", max_num_batched_tokens=64)
    submit(sched, TenantTag("t"), prompt_len=10, max_tokens=5)
    while sched.has_unfinished():
        step(sched, model)
    (t,) = sched.stats.tenants
    # 10 prompt tokens in one chunk (the first output comes with it), then 4 decodes
    assert (t.name, t.num_prompt_tokens, t.num_generation_tokens) == ("t", 10, 4)
    assert (t.num_waiting, t.num_running, t.num_kv_blocks) == (0, 0, 0)


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    policy=st.sampled_from(["fair", "fcfs", "priority"]),
    mode=st.sampled_from(["recompute", "swap"]),
    num_blocks=st.integers(6, 16),
    budget=st.integers(8, 40),
    max_num_seqs=st.integers(1, 6),
)
def test_random_multi_tenant_traffic_completes_correctly_without_leaks(
    data: st.DataObject, policy: str, mode: str, num_blocks: int, budget: int, max_num_seqs: int
) -> None:
    clock = FakeClock()
    num_cpu_blocks = data.draw(st.integers(0, 12))
    config = EngineConfig(
        scheduling_policy=policy,
        fair_max_wait_s=data.draw(st.sampled_from([3.0, 30.0])),
        fair_contended_prefill_tokens=data.draw(st.sampled_from([0, 1, 5, 256])),
        fair_short_prefill_tokens=data.draw(st.sampled_from([0, 1, 8, 256])),
        fair_batch_prefill_tokens=data.draw(st.sampled_from([0, 1, 4, 64])),
        fair_contention_window_s=data.draw(st.sampled_from([0.0, 4.0, 300.0])),
        fair_batch_window_s=data.draw(st.sampled_from([0.0, 4.0])),
        num_gpu_blocks_override=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        preemption_mode=mode,
    )
    sched = Scheduler(
        config, num_blocks, max_model_len=64, num_cpu_blocks=num_cpu_blocks, clock=clock
    )
    model = PagedTokenModel(num_blocks, num_cpu_blocks, 4)
    tenants = [
        TenantTag(
            f"t{i}",
            weight=data.draw(st.sampled_from([0.5, 1.0, 3.0])),
            priority_class=data.draw(st.sampled_from(["interactive", "batch"])),
            kv_share=data.draw(st.sampled_from([0.2, 0.5, 1.0])),
        )
        for i in range(3)
    ]
    pending = []
    for i in range(data.draw(st.integers(1, 14))):
        prompt = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20))
        max_tokens = data.draw(st.integers(1, 24))
        try:
            sched.check_fits(len(prompt), max_tokens)
        except ParameterError:
            continue
        tenant = data.draw(st.sampled_from(tenants))
        arrive_at = data.draw(st.integers(0, 10))
        abort_at = data.draw(st.one_of(st.none(), st.integers(0, 30)))
        pending.append((arrive_at, abort_at, f"r{i}", prompt, max_tokens, tenant))
    reqs: dict[str, Request] = {}
    aborted = set()
    for t in range(3000):
        clock.now = float(t)
        for arrive_at, abort_at, rid, prompt, max_tokens, tenant in pending:
            if arrive_at == t:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                reqs[rid] = Request(rid, prompt, params, arrival_time=t, tenant=tenant)
                sched.add_request(reqs[rid])
            if abort_at == t and rid in reqs and not reqs[rid].is_finished:
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if t > 10 and not sched.has_unfinished():
            break
        step(sched, model)
        used = sched.kv.stats().num_used_gpu_blocks
        assert sum(sched.kv.tenant_blocks().values()) >= used  # every held block is charged
    else:
        raise AssertionError("livelock: requests never finished")
    assert_no_leaks(sched)
    assert sched.kv.tenant_blocks() == {} and len(sched.waiting) == 0
    for rid, req in reqs.items():
        if rid not in aborted:
            want = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens or 0)
            assert req.output_token_ids == want and req.finish_reason == "length"


# -- the real engine -----------------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
def test_greedy_outputs_are_identical_under_every_policy(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tenants = [
        TenantTag("a"),
        TenantTag("b", weight=3.0),
        TenantTag("c", priority_class="batch", kv_share=0.3),
    ]
    prompts = [[(start * 37 + 7 * i) % 4000 + 10 for i in range(20 + start)] for start in range(9)]
    outputs = {}
    for policy in ("fcfs", "priority", "fair"):
        # 16 blocks of 16 tokens: nine 45-token requests cannot all fit, so some are preempted.
        engine = make_engine(tiny, num_gpu_blocks_override=16, scheduling_policy=policy)
        for i, prompt in enumerate(prompts):
            engine.add_request(
                f"r{i}", prompt, params, tenant=tenants[i % 3], priority=i % 2, arrival_time=i
            )
        final = run_all(engine)
        outputs[policy] = {rid: out.outputs[0].token_ids for rid, out in final.items()}
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_total_blocks
        assert {t.name for t in stats.tenants} == {"a", "b", "c"}
    assert outputs["fcfs"] == outputs["priority"] == outputs["fair"]
    assert len(outputs["fair"]) == 9


def test_a_prefills_reserve_never_takes_a_running_decodes_token() -> None:
    """Random multi-tenant traffic with small budgets under fair: every request decoding at
    the start of a step is scheduled in it (when the step preempts nobody and the decodes fit
    the budget). A negative reserve once let a prefill take a decode's token."""
    import random

    starved = 0
    for seed in range(150):
        rng = random.Random(seed)
        budget = rng.randint(2, 12)
        sched, model = make(
            "fair",
            num_blocks=64,
            max_num_batched_tokens=budget,
            max_num_seqs=rng.randint(2, 6),
            fair_contended_prefill_tokens=rng.choice([0, 1, 3]),
            fair_short_prefill_tokens=rng.choice([0, 2, 256]),
            fair_batch_prefill_tokens=rng.choice([0, 1, 64]),
        )
        for _ in range(40):
            if rng.random() < 0.5:
                tenant = TenantTag(rng.choice("abc"))
                submit(sched, tenant, prompt_len=rng.randint(1, 20), max_tokens=rng.randint(1, 6))
            if not sched.has_unfinished():
                continue
            decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
            out, _ = step(sched, model)
            scheduled = {r.request_id for r, _ in out.scheduled}
            if not out.num_preempted and len(decoding) <= budget:
                starved += sum(r.request_id not in scheduled for r in decoding)
    assert starved == 0
