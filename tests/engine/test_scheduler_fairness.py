"""Tenants inside the scheduler: weighted token shares, bounded waits, classes, preemption
victims and KV quotas, with the simulated paged model of test_scheduler.py (so every output is
also checked against a plain loop); then greedy outputs of the real tiny engine under every
policy.

Waits are counted in scheduler steps and the wait bound runs on an injected clock: nothing
here depends on wall time or thread count.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.tenancy import TenantTag
from tests.engine.test_scheduler import (
    VOCAB,
    PagedTokenModel,
    assert_no_leaks,
    reference_output,
    step,
)
from tests.engine.test_scheduler import run_all as run_to_the_end


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    policy: str = "fair", num_blocks: int = 256, clock: Callable[[], float] | None = None, **flags
) -> tuple[Scheduler, PagedTokenModel]:
    flags.setdefault("block_size", 4)
    config = EngineConfig(scheduling_policy=policy, num_gpu_blocks_override=num_blocks, **flags)
    sched = Scheduler(
        config,
        num_blocks,
        max_model_len=512,
        num_cpu_blocks=flags.get("num_cpu_blocks", 0),
        hash_seed=b"\0" * 32,
        clock=clock or FakeClock(),
    )
    return sched, PagedTokenModel(num_blocks, 0, config.block_size)


_counter = iter(range(10**9))


def submit(
    sched: Scheduler,
    tenant: TenantTag,
    prompt_len: int = 8,
    max_tokens: int = 8,
    index: int | None = None,
    **kw,
) -> Request:
    """A request of ``tenant``; ``index`` (default: a fresh one) fixes its id, prompt and
    arrival time."""
    i = next(_counter) if index is None else index
    prompt = [(i * 7 + j) % (VOCAB - 1) + 1 for j in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sched.check_fits(len(prompt), max_tokens)
    kw.setdefault("arrival_time", float(i))
    r = Request(f"{tenant.name}-{i}", prompt, params, tenant=tenant, **kw)
    sched.add_request(r)
    return r


def tokens_of(sched: Scheduler, name: str) -> int:
    return sum(sched.tenant_tokens.get(name, (0, 0)))


# -- shares --------------------------------------------------------------------------------


def saturated_split(policy: str) -> float:
    """Two tenants that always have 20 requests waiting; B's weight is 3, A's 1."""
    sched, model = make(policy, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = TenantTag("a", weight=1.0), TenantTag("b", weight=3.0)
    for _ in range(20):
        submit(sched, a)
        submit(sched, b)
    for _ in range(600):
        _, finished = step(sched, model)
        for r in finished:  # keep both backlogged: one new request per finished one
            submit(sched, r.tenant)
            assert r.output_token_ids == reference_output(r.prompt_token_ids, 8)
    return tokens_of(sched, "b") / tokens_of(sched, "a")


def test_weights_one_to_three_split_tokens_one_to_three_under_saturation() -> None:
    assert saturated_split("fair") == pytest.approx(3.0, rel=0.10)
    assert saturated_split("fcfs") == pytest.approx(1.0, rel=0.10)  # weights ignored there


def test_one_tenant_schedules_exactly_as_fcfs() -> None:
    plans = []
    for policy in ("fcfs", "fair"):
        sched, model = make(policy, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
        for i in range(12):
            submit(sched, TenantTag(), prompt_len=4 + i % 5, max_tokens=6 + i % 4, index=i)
        plan = []
        while sched.has_unfinished():
            out, _ = step(sched, model)
            plan.append([(r.request_id, n) for r, n in out.scheduled])
        plans.append(plan)
        assert_no_leaks(sched)
    assert plans[0] == plans[1]


# -- bounded waiting -----------------------------------------------------------------------


def steps_until_scheduled(policy: str) -> tuple[int, int]:
    """A floods 50 requests; once they saturate the engine, Q sends one. Returns the steps Q
    waited and how many of A's requests were admitted after Q arrived and before it."""
    sched, model = make(policy, max_num_seqs=4, max_num_batched_tokens=64)
    flood = TenantTag("flood")
    for _ in range(50):
        submit(sched, flood, prompt_len=8, max_tokens=16)
    for _ in range(3):
        step(sched, model)
    quiet = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=4)
    waiting_flood = {r.request_id for r in sched.waiting if r.tenant.name == "flood"}
    steps, overtakes = 0, 0
    while quiet.status == RequestStatus.WAITING:
        out, _ = step(sched, model)
        steps += 1
        for r, _ in out.scheduled:  # admissions come in the order they were picked
            if r is quiet:
                break
            if r.request_id in waiting_flood and r.num_computed_tokens == 0:
                overtakes += 1
    return steps, overtakes


def test_a_flooding_tenant_cannot_delay_another_beyond_one_request() -> None:
    fair_steps, fair_overtakes = steps_until_scheduled("fair")
    fcfs_steps, fcfs_overtakes = steps_until_scheduled("fcfs")
    # Fair: Q waits only for a running request to finish (16 decode steps at most), and at
    # most one of the flood's waiting requests is admitted first (the tie at the lift).
    assert fair_steps <= 16 and fair_overtakes <= 1
    # FCFS: Q waits behind all 46 waiting flood requests, 4 at a time.
    assert fcfs_steps > 150 and fcfs_overtakes == 0  # they have all finished meanwhile


def first_step_with(policy: str, short_prefill_tokens: int = 0) -> dict[str, int]:
    """N's 200-token prompt is being prefilled 32 tokens a step; Q sends 8 tokens. The
    tokens each tenant gets in the next step."""
    sched, model = make(
        policy,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        fair_contended_prefill_tokens=0,
        fair_short_prefill_tokens=short_prefill_tokens,
    )
    submit(sched, TenantTag("noisy"), prompt_len=200, max_tokens=4)
    step(sched, model)
    submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=4)
    out, _ = step(sched, model)
    return {r.tenant.name: n for r, n in out.scheduled}


def test_a_new_tenants_prompt_does_not_get_the_leftovers_of_a_long_running_prefill() -> None:
    # Fair: Q's whole prompt runs in the next step; N's chunk makes room for it.
    assert first_step_with("fair") == {"noisy": 24, "quiet": 8}
    # FCFS: the running prefill goes first and takes the whole budget.
    assert first_step_with("fcfs") == {"noisy": 32}


def test_a_new_tenants_short_prompt_runs_without_the_others_prefill() -> None:
    # Q's 8 tokens are short (at most 8): N's chunk sits out, keeping the one token that
    # guarantees it progress, so Q's step is short.
    assert first_step_with("fair", short_prefill_tokens=8) == {"noisy": 1, "quiet": 8}
    # One token more than the limit: N only makes room, as above.
    assert first_step_with("fair", short_prefill_tokens=7) == {"noisy": 24, "quiet": 8}
    assert first_step_with("fcfs", short_prefill_tokens=8) == {"noisy": 32}


def make_short_steps(budget: int) -> tuple[Scheduler, PagedTokenModel]:
    """fair with short steps of up to 16 tokens, no contended cap, 8 slots."""
    return make(
        "fair",
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        fair_contended_prefill_tokens=0,
        fair_short_prefill_tokens=16,
    )


def test_a_short_step_admits_none_of_the_waiting_requests_of_the_flow_served_more() -> None:
    """N has requests running and waiting (the budget admits them slowly); Q's 8 tokens
    arrive, lifted to tie with N. Q's step carries Q's prompt, one token of each of N's running
    prefills and none of N's waiting requests: the tie goes to the smaller need."""
    sched, model = make_short_steps(budget=32)
    noisy = [submit(sched, TenantTag("noisy"), prompt_len=60, max_tokens=2) for _ in range(6)]
    step(sched, model)
    step(sched, model)
    waiting_before = {r.request_id for r in noisy if r.status == RequestStatus.WAITING}
    assert waiting_before  # the premise: N has waiting requests
    quiet = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=2)
    out, _ = step(sched, model)
    planned = {r.request_id: n for r, n in out.scheduled}
    assert planned.pop(quiet.request_id) == 8
    assert planned and all(n == 1 for n in planned.values())  # N's running prefills: 1 each
    assert not waiting_before & planned.keys()  # none of N's waiting ones admitted
    run_to_the_end(sched, model)
    for r in [*noisy, quiet]:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 2)
    assert_no_leaks(sched)


def test_a_tenants_favoured_class_runs_while_its_other_class_sits_out() -> None:
    """One tenant has a long batch prompt waiting and a short interactive one; another tenant's
    long prefill runs. The short step is the interactive flow's: the same tenant's batch
    request is held, not admitted beside it."""
    sched, model = make_short_steps(budget=64)
    other = submit(sched, TenantTag("other"), prompt_len=300, max_tokens=2)
    step(sched, model)
    bulk = submit(sched, TenantTag("t", priority_class="batch"), prompt_len=40, max_tokens=2)
    chat = submit(sched, TenantTag("t"), prompt_len=8, max_tokens=2)
    out, _ = step(sched, model)
    planned = {r.request_id: n for r, n in out.scheduled}
    assert planned == {chat.request_id: 8, other.request_id: 1}
    assert bulk.status == RequestStatus.WAITING
    run_to_the_end(sched, model)
    for r in (other, bulk, chat):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 2)
    assert_no_leaks(sched)


def quiet_chunk_after_noisy_newcomer(quiet_weight: float) -> int:
    """N's short request runs beside Q's 400-token prompt and ends; then N sends an 8-token
    prompt, lifted (no credit for idling) to Q's counter if that is higher. The tokens Q's
    prefill gets in the next step."""
    sched, model = make_short_steps(budget=32)
    noisy, quiet = TenantTag("noisy"), TenantTag("quiet", weight=quiet_weight)
    submit(sched, noisy, prompt_len=8, max_tokens=2)
    long_quiet = submit(sched, quiet, prompt_len=400, max_tokens=2)
    for _ in range(5):
        step(sched, model)
    submit(sched, noisy, prompt_len=8, max_tokens=2)
    out, _ = step(sched, model)
    planned = {r.request_id: n for r, n in out.scheduled}
    run_to_the_end(sched, model)
    assert long_quiet.output_token_ids == reference_output(long_quiet.prompt_token_ids, 2)
    assert_no_leaks(sched)
    return planned[long_quiet.request_id]


def test_only_a_tenant_served_less_makes_others_sit_out() -> None:
    # Weight 100: Q's ~150 prefill tokens count 1.5 against N's 9, so N is served more and
    # its new short prompt waits for room: Q's chunk takes the whole budget.
    assert quiet_chunk_after_noisy_newcomer(quiet_weight=100.0) == 32
    # Weight 1: N's arrival ties it with Q, so Q's chunk sits out for N's short prompt.
    assert quiet_chunk_after_noisy_newcomer(quiet_weight=1.0) == 1


def test_a_reserve_never_stalls_a_running_prefill_when_no_slot_is_free() -> None:
    # One running slot: Q cannot be admitted until N finishes, so N keeps the whole budget.
    sched, model = make(
        "fair", max_num_seqs=1, max_num_batched_tokens=32, fair_contended_prefill_tokens=0
    )
    noisy = submit(sched, TenantTag("noisy"), prompt_len=100, max_tokens=2)
    step(sched, model)
    quiet = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=2)
    out, _ = step(sched, model)
    assert [(r.request_id, n) for r, n in out.scheduled] == [(noisy.request_id, 32)]
    run_to_the_end(sched, model)
    assert quiet.output_token_ids == reference_output(quiet.prompt_token_ids, 2)
    assert_no_leaks(sched)


def prefill_tokens(out: SchedulerOutput) -> int:
    return sum(n for r, n in out.scheduled if r.num_computed_tokens < r.num_prompt_tokens)


def test_steps_are_capped_while_tenants_contend_and_not_after_the_window() -> None:
    clock = FakeClock()
    sched, model = make(
        "fair",
        clock=clock,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        fair_contended_prefill_tokens=16,
        fair_contention_window_s=5.0,
    )
    for _ in range(4):
        submit(sched, TenantTag("noisy"), prompt_len=400, max_tokens=4)
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == 64  # one tenant: the whole budget
    quiet = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=2)
    while not quiet.is_finished:
        out, _ = step(sched, model)
        assert prefill_tokens(out) <= 16
    assert quiet.output_token_ids == reference_output(quiet.prompt_token_ids, 2)
    clock.now += 4.0  # Q gone, but within the window: still capped
    out, _ = step(sched, model)
    assert prefill_tokens(out) <= 16
    clock.now += 1.5  # the window has passed: N alone gets the whole budget again
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == 64


def test_a_tenant_back_within_the_window_finds_capped_steps_and_one_tenant_is_never_capped() -> (
    None
):
    """Issue 43's first request: N ran alone for a while since Q's last request; the step in
    flight when Q comes back is still a capped one, because Q is remembered for the window on
    its own (not only while both have work), and Q's first token comes one step after it
    arrives. An engine only N ever used runs full steps."""
    clock = FakeClock()
    flags = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        fair_contended_prefill_tokens=16,
        fair_contention_window_s=100.0,
        fair_max_wait_s=1000.0,  # the clock jumps 4.5 s a step: no request is overdue here
    )
    alone, alone_model = make("fair", clock=FakeClock(), **flags)
    sched, model = make("fair", clock=clock, **flags)
    quiet = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=2)
    while not quiet.is_finished:
        step(sched, model)
    noisy = TenantTag("noisy")
    for s in (sched, alone):
        for _ in range(6):
            submit(s, noisy, prompt_len=200, max_tokens=4)
    for _ in range(20):  # N alone, 90 s after Q's last request: still capped
        clock.now += 4.5
        out, _ = step(sched, model)
        assert 0 < prefill_tokens(out) <= 16
        out, _ = step(alone, alone_model)
        assert out.num_scheduled_tokens == 64  # never a second tenant: the whole budget
        for s in (sched, alone):  # N keeps six requests in flight
            while len(s.requests) < 6:
                submit(s, noisy, prompt_len=200, max_tokens=4)
    back = submit(sched, TenantTag("quiet"), prompt_len=8, max_tokens=2)
    out, _ = step(sched, model)
    assert back.num_output_tokens == 1  # its first token in the step after it arrived
    assert back.output_token_ids == reference_output(back.prompt_token_ids, 1)
    while not back.is_finished:
        step(sched, model)
    clock.now += 101.0  # Q's window has passed: N alone gets the whole budget back
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == 64


def batch_prefill_per_step(policy: str) -> tuple[list[int], int]:
    """A batch tenant's long prompts next to an interactive tenant's short requests: the batch
    class's prefill tokens in each step while the chats run, then (the window passed, no chat
    left) in one step alone."""
    clock = FakeClock()
    sched, model = make(
        policy,
        clock=clock,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        fair_contended_prefill_tokens=0,
        fair_short_prefill_tokens=0,
        fair_batch_prefill_tokens=12,
        fair_batch_window_s=5.0,
    )
    bulk = [
        submit(sched, TenantTag("bulk", priority_class="batch"), prompt_len=200, max_tokens=2)
        for _ in range(3)
    ]
    chats = [submit(sched, TenantTag("chat"), prompt_len=8, max_tokens=6) for _ in range(2)]
    shares = []
    while not all(c.is_finished for c in chats):
        out, _ = step(sched, model)
        shares.append(sum(n for r, n in out.scheduled if r.tenant.priority_class == "batch"))
    for c in chats:
        assert c.output_token_ids == reference_output(c.prompt_token_ids, 6)
    clock.now += 6.0  # past the window; only the batch is left
    out, _ = step(sched, model)
    alone = sum(n for _, n in out.scheduled)
    run_to_the_end(sched, model)
    for r in bulk:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 2)
    assert_no_leaks(sched)
    return shares, alone


def test_batch_prefill_is_kept_small_while_interactive_requests_run() -> None:
    shares, alone = batch_prefill_per_step("fair")
    assert max(shares) <= 12 and sum(shares) > 0  # capped, never stalled
    assert alone == 64  # alone again after the window: the whole budget
    # priority has the class order but no cap: the batch fills what the chats leave
    shares, alone = batch_prefill_per_step("priority")
    assert max(shares) > 12 and alone == 64


def test_fcfs_never_caps_a_step() -> None:
    sched, model = make(
        "fcfs", max_num_seqs=8, max_num_batched_tokens=64, fair_contended_prefill_tokens=16
    )
    submit(sched, TenantTag("noisy"), prompt_len=400, max_tokens=4)
    submit(sched, TenantTag("quiet"), prompt_len=400, max_tokens=4)
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == 64


def test_interactive_runs_before_batch_that_arrived_first() -> None:
    sched, model = make("fair", max_num_seqs=1)
    batch = submit(sched, TenantTag("bulk", priority_class="batch"), arrival_time=0.0)
    chat = submit(sched, TenantTag("chat"), arrival_time=1.0)
    step(sched, model)
    assert chat.status == RequestStatus.RUNNING and batch.status == RequestStatus.WAITING


def batch_wait(policy: str, max_steps: int = 200) -> int | None:
    """Interactive traffic never lets up; one batch request waits. Steps until it runs (1 s
    of fake clock per step, fair_max_wait_s=20), or None if it never did."""
    clock = FakeClock()
    sched, model = make(policy, clock=clock, max_num_seqs=2, fair_max_wait_s=20.0)
    chat = TenantTag("chat")
    for _ in range(4):
        submit(sched, chat, max_tokens=4)
    batch = submit(sched, TenantTag("bulk", priority_class="batch"), max_tokens=4)
    for n in range(1, max_steps + 1):
        clock.now += 1.0
        _, finished = step(sched, model)
        if batch.status != RequestStatus.WAITING:
            return n
        for _ in finished:
            submit(sched, chat, max_tokens=4)
    return None


def test_batch_is_not_starved_beyond_the_wait_bound() -> None:
    waited = batch_wait("fair")
    # Not before the bound (interactive goes first), and at the first free slot after it.
    assert waited is not None and 20 <= waited <= 20 + 12
    assert batch_wait("priority") is None  # no bound there: starved for all 200 steps
