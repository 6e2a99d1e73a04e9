"""Scheduler: token budget, chunked prefill, priorities, preemption (recompute and swap), stops.

No model is needed: :class:`PagedTokenModel` stands in for the model runner. It keeps a real
paged "KV cache" whose slot for a token holds ``(position, token_id)``, carries out the swap
copies, and before writing a request's new tokens checks that every earlier position of the
request reads back the right token through its block table. So a wrong block table, a prefix
hit on the wrong block, or a lost swap shows up as wrong context. Its next token is a
deterministic function of the whole context, so a request must produce exactly the output a
plain loop produces, however often it is preempted.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import ParameterError, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 0  # the simulated model only produces EOS when a test asks for it


def next_token(context: list[int]) -> int:
    return 1 + (sum(context) * 31 + len(context) * 7) % (VOCAB - 1)


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class PagedTokenModel:
    """A model runner over a paged KV cache of (position, token id) entries."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.gpu: list[tuple[int, int] | None] = [None] * (num_gpu_blocks * block_size)
        self.cpu: list[tuple[int, int] | None] = [None] * (num_cpu_blocks * block_size)

    def _copy(self, src: list, src_block: int, dst: list, dst_block: int) -> None:
        bs = self.bs
        dst[dst_block * bs : (dst_block + 1) * bs] = src[src_block * bs : (src_block + 1) * bs]

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        for gpu_block, cpu_block in out.swap_out:
            self._copy(self.gpu, gpu_block, self.cpu, cpu_block)
        for cpu_block, gpu_block in out.swap_in:
            self._copy(self.cpu, cpu_block, self.gpu, gpu_block)
        sampled: dict[str, int] = {}
        for req, num_new in out.scheduled:
            table = out.block_tables[req.request_id]
            start, tokens = req.num_computed_tokens, req.all_token_ids
            for p in range(start):
                slot = table[p // self.bs] * self.bs + p % self.bs
                assert self.gpu[slot] == (p, tokens[p]), f"{req.request_id}: bad KV at {p}"
            for p in range(start, start + num_new):
                self.gpu[table[p // self.bs] * self.bs + p % self.bs] = (p, tokens[p])
            if start + num_new == req.num_tokens:
                sampled[req.request_id] = next_token(tokens)
        return sampled


def make_scheduler(
    num_blocks: int = 64, max_model_len: int = 512, num_cpu_blocks: int = 0, **flags
) -> tuple[Scheduler, PagedTokenModel]:
    flags.setdefault("block_size", 4)
    config = EngineConfig(num_gpu_blocks_override=num_blocks, **flags)
    sched = Scheduler(
        config,
        num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
        num_cpu_blocks=num_cpu_blocks,
        hash_seed=b"\0" * 32,
    )
    return sched, PagedTokenModel(num_blocks, num_cpu_blocks, config.block_size)


def add(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> Request:
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sched.check_fits(len(prompt), params.max_tokens)
    req = Request(rid, prompt, params, **kw)
    sched.add_request(req)
    return req


def step(sched: Scheduler, model: PagedTokenModel) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    config = sched.config
    assert out.num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    assert len(out.scheduled) == len({r.request_id for r, _ in out.scheduled})
    return out, sched.update_from_output(out, model.execute(out))


def run_all(sched: Scheduler, model: PagedTokenModel, max_steps: int = 10_000) -> int:
    steps = 0
    while sched.has_unfinished():
        step(sched, model)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def assert_no_leaks(sched: Scheduler) -> None:
    stats = sched.kv.stats()
    assert stats.num_used_gpu_blocks == 0 and stats.num_used_cpu_blocks == 0
    assert not sched.running and not sched.waiting and not sched.requests
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


# -- budget, chunking, ordering ------------------------------------------------------------


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=10)
    a = add(sched, "a", list(range(1, 5)), max_tokens=5)
    out, _ = step(sched, model)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 4)]
    b = add(sched, "b", list(range(30, 55)), max_tokens=2)  # 25 tokens, budget 10
    chunks = []
    while b.num_output_tokens == 0:
        out, _ = step(sched, model)
        assert out.scheduled[0] == (a, 1) or a.is_finished  # the decode comes first
        chunks.append(dict((r.request_id, n) for r, n in out.scheduled).get("b"))
    assert chunks == [9, 9, 7]  # one token of each step's budget was reserved for a's decode
    run_all(sched, model)
    assert a.output_token_ids == reference_output(a.prompt_token_ids, 5)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 2)
    assert_no_leaks(sched)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched, model = make_scheduler(max_num_batched_tokens=12, enable_chunked_prefill=False)
    add(sched, "a", list(range(1, 9)), max_tokens=3)  # 8 tokens
    add(sched, "b", list(range(20, 30)), max_tokens=3)  # 10 tokens: does not fit beside a
    out, _ = step(sched, model)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 8)]
    out, _ = step(sched, model)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 10)]
    with pytest.raises(ParameterError) as info:
        sched.check_fits(13, 1)
    assert info.value.param == "prompt" and "--max-num-batched-tokens" in str(info.value)
    run_all(sched, model)
    assert_no_leaks(sched)


def test_max_num_seqs_caps_the_running_set() -> None:
    sched, model = make_scheduler(max_num_seqs=2)
    reqs = [add(sched, f"r{i}", [i + 1] * 3, max_tokens=4) for i in range(5)]
    out, _ = step(sched, model)
    assert {r.request_id for r, _ in out.scheduled} == {"r0", "r1"}
    assert len(sched.waiting) == 3
    run_all(sched, model)
    assert all(r.output_token_ids == reference_output(r.prompt_token_ids, 4) for r in reqs)


def test_priority_then_arrival_order() -> None:
    sched, model = make_scheduler(max_num_seqs=1)
    add(sched, "late-low", [1, 2], max_tokens=1, priority=5, arrival_time=1.0)
    add(sched, "early-low", [1, 2], max_tokens=1, priority=5, arrival_time=0.5)
    add(sched, "high", [1, 2], max_tokens=1, priority=-1, arrival_time=9.0)
    order = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        order += [r.request_id for r, _ in out.scheduled]
    assert order == ["high", "early-low", "late-low"]


# -- preemption ----------------------------------------------------------------------------


def test_recompute_preempts_the_newest_and_resumes_with_the_same_output() -> None:
    # 8 blocks of 4 tokens; two 12-token prompts growing by 12 tokens each cannot both fit.
    sched, model = make_scheduler(num_blocks=8)
    old = add(sched, "old", list(range(1, 13)), max_tokens=12, arrival_time=1.0)
    new = add(sched, "new", list(range(20, 32)), max_tokens=12, arrival_time=2.0)
    preempted_at = None
    while sched.has_unfinished():
        out, _ = step(sched, model)
        if out.num_preempted and preempted_at is None:
            preempted_at = new.num_output_tokens
            assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
            assert new.block_ids == [] and old.status == RequestStatus.RUNNING
            assert sched.policy.peek() is new  # next in line
    assert preempted_at is not None and new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.output_token_ids == reference_output(old.prompt_token_ids, 12)
    assert new.output_token_ids == reference_output(new.prompt_token_ids, 12)
    assert sched.stats.num_preemptions >= 1
    assert_no_leaks(sched)


def test_lowest_priority_is_preempted_first() -> None:
    sched, model = make_scheduler(num_blocks=8)
    vip = add(sched, "vip", list(range(1, 13)), max_tokens=12, priority=0, arrival_time=5.0)
    low = add(sched, "low", list(range(20, 32)), max_tokens=12, priority=1, arrival_time=1.0)
    run_all(sched, model)
    assert vip.num_preemptions == 0 and low.num_preemptions >= 1
    assert low.output_token_ids == reference_output(low.prompt_token_ids, 12)


def test_swap_moves_blocks_out_and_back_and_frees_the_cpu_pool() -> None:
    sched, model = make_scheduler(num_blocks=8, num_cpu_blocks=8, preemption_mode="swap")
    old = add(sched, "old", list(range(1, 13)), max_tokens=12)
    new = add(sched, "new", list(range(20, 32)), max_tokens=12)
    swapped_out: list[tuple[int, int]] = []
    swapped_in: list[tuple[int, int]] = []
    while sched.has_unfinished():
        out, _ = step(sched, model)
        if out.swap_out:
            assert new.status == RequestStatus.SWAPPED and new.num_computed_tokens > 0
            assert sched.kv.stats().num_used_cpu_blocks == len(out.swap_out)
            swapped_out = out.swap_out
        if out.swap_in:
            swapped_in = out.swap_in
            assert new.status == RequestStatus.RUNNING
            assert sched.kv.stats().num_used_cpu_blocks == 0
    assert swapped_out and swapped_in
    assert sorted(c for _, c in swapped_out) == sorted(c for c, _ in swapped_in)
    assert old.output_token_ids == reference_output(old.prompt_token_ids, 12)
    assert new.output_token_ids == reference_output(new.prompt_token_ids, 12)
    assert_no_leaks(sched)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full() -> None:
    sched, model = make_scheduler(num_blocks=8, num_cpu_blocks=1, preemption_mode="swap")
    add(sched, "old", list(range(1, 13)), max_tokens=12)
    new = add(sched, "new", list(range(20, 32)), max_tokens=12)
    saw_recompute = False
    while sched.has_unfinished():
        out, _ = step(sched, model)
        if out.num_preempted:
            assert not out.swap_out and new.status == RequestStatus.WAITING
            saw_recompute = True
    assert saw_recompute
    assert new.output_token_ids == reference_output(new.prompt_token_ids, 12)
    assert_no_leaks(sched)


def test_a_request_larger_than_the_pool_is_refused_upfront() -> None:
    sched, model = make_scheduler(num_blocks=4, max_model_len=100)  # 16 token slots
    assert sched.max_model_len == 16
    sched.check_fits(10, 6)
    with pytest.raises(ParameterError) as info:
        sched.check_fits(10, 7)
    assert info.value.param == "max_tokens" and "--kv-cache-memory" in str(info.value)
    with pytest.raises(ParameterError, match="^prompt is 16 tokens; the KV cache"):
        sched.check_fits(16, None)


def test_unbounded_max_tokens_stops_at_what_the_pool_holds() -> None:
    sched, model = make_scheduler(num_blocks=4, max_model_len=100)
    req = add(sched, "a", [1, 2, 3], params=SamplingParams(max_tokens=None, ignore_eos=True))
    run_all(sched, model)
    assert req.num_tokens == 16 and req.finish_reason == "length"
    assert_no_leaks(sched)


def test_context_limit_guards() -> None:
    sched, _ = make_scheduler(max_model_len=32)
    sched.check_fits(31, 1)
    with pytest.raises(ParameterError) as info:
        sched.check_fits(32, 1)
    assert info.value.param == "prompt"
    with pytest.raises(ParameterError) as info:
        sched.check_fits(20, 13)
    assert info.value.param == "max_tokens" and "32" in str(info.value)
    with pytest.raises(ParameterError):
        sched.check_fits(0, 1)


# -- stops, abort, prefix sharing ----------------------------------------------------------


def run_one(params: SamplingParams, produce: list[int], max_model_len: int = 512) -> Request:
    """Run a single request whose 'model' emits ``produce`` (then the usual tokens)."""
    sched, model = make_scheduler(max_model_len=max_model_len)
    req = add(sched, "r", [1, 2, 3], params=params)
    while sched.has_unfinished():
        out = sched.schedule()
        model.execute(out)
        k = req.num_output_tokens
        sched.update_from_output(out, {"r": produce[k] if k < len(produce) else 5})
    assert_no_leaks(sched)
    return req


def test_eos_stops_unless_ignored_or_below_min_tokens() -> None:
    req = run_one(SamplingParams(max_tokens=10), [7, EOS, 7])
    assert req.output_token_ids == [7, EOS] and req.finish_reason == "stop"
    assert req.stop_reason is None
    req = run_one(SamplingParams(max_tokens=4, ignore_eos=True), [EOS, EOS])
    assert req.num_output_tokens == 4 and req.finish_reason == "length"
    req = run_one(SamplingParams(max_tokens=10, min_tokens=3), [EOS, EOS, EOS, EOS])
    assert req.num_output_tokens == 3 and req.finish_reason == "stop"


def test_stop_token_ids_set_the_stop_reason() -> None:
    req = run_one(SamplingParams(max_tokens=10, stop_token_ids=[9]), [4, 9, 4])
    assert req.output_token_ids == [4, 9] and req.stop_reason == 9
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_ends_with_length() -> None:
    req = run_one(SamplingParams(max_tokens=None), [], max_model_len=8)
    assert req.num_tokens == 8 and req.finish_reason == "length"


def test_abort_frees_blocks_at_once_from_running_and_waiting() -> None:
    sched, model = make_scheduler(max_num_seqs=1)
    a = add(sched, "a", list(range(1, 30)), max_tokens=50)
    b = add(sched, "b", list(range(1, 9)), max_tokens=5)
    step(sched, model)
    assert sched.kv.stats().num_used_gpu_blocks > 0
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort" and a.block_ids == []
    assert sched.kv.stats().num_used_gpu_blocks == 0 and not sched.running
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)  # unknown now: no-op
    assert b.is_finished and not sched.has_unfinished()
    with pytest.raises(ValueError):
        sched.finish_request("x", RequestStatus.RUNNING)
    assert_no_leaks(sched)


def test_stop_string_finish_by_the_engine_loop_keeps_the_reason() -> None:
    sched, model = make_scheduler()
    req = add(sched, "a", [1, 2, 3], max_tokens=10)
    step(sched, model)
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert req.finish_reason == "stop" and req.stop_reason == "\n\n"
    assert_no_leaks(sched)


def test_duplicate_request_id_is_refused() -> None:
    sched, _ = make_scheduler()
    add(sched, "a", [1, 2])
    with pytest.raises(ValueError, match="already"):
        add(sched, "a", [1, 2])


def test_later_request_reuses_the_cached_prefix() -> None:
    sched, model = make_scheduler(block_size=16, num_blocks=100)
    prefix = [(i * 7) % 40 + 1 for i in range(400)]
    first = add(sched, "first", [*prefix, 1, 2], max_tokens=2)
    run_all(sched, model)
    second = add(sched, "second", [*prefix, 3, 4, 5], max_tokens=2)
    out, _ = step(sched, model)
    assert second.num_cached_tokens == 400 and out.scheduled == [(second, 3)]
    run_all(sched, model)
    assert second.output_token_ids == reference_output(second.prompt_token_ids, 2)
    assert first.output_token_ids == reference_output(first.prompt_token_ids, 2)
    stats = sched.stats
    assert stats.prefix_cache_hits == 400 and stats.prefix_cache_queries == 402 + 403


def test_n_children_share_the_prompt_blocks_once_computed() -> None:
    sched, model = make_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks
    params = SamplingParams(n=2, max_tokens=3, ignore_eos=True)
    c0 = add(sched, "req-0", prompt, params=params)
    c1 = add(sched, "req-1", list(prompt), params=params)
    step(sched, model)  # c0's first 16-token chunk takes the whole budget
    step(sched, model)  # c0 finishes its prefill; c1 starts and hits c0's computed blocks
    assert c1.num_cached_tokens == 16
    assert c0.block_ids[:4] == c1.block_ids[:4]
    assert all(sched.kv.pool.blocks[b].ref_cnt == 2 for b in c0.block_ids[:4])
    run_all(sched, model)
    assert c0.output_token_ids == c1.output_token_ids == reference_output(prompt, 3)
    assert_no_leaks(sched)


def test_stats_snapshot() -> None:
    sched, model = make_scheduler(num_blocks=10, max_num_seqs=1)
    add(sched, "a", list(range(1, 9)), max_tokens=4)
    add(sched, "b", [1, 2], max_tokens=4)
    step(sched, model)
    stats = sched.stats
    assert (stats.num_running, stats.num_waiting, stats.num_gpu_blocks) == (1, 1, 10)
    assert stats.num_used_gpu_blocks == 2 and stats.kv_cache_usage == pytest.approx(0.2)
    assert stats.prefix_cache_queries == 8 and stats.num_preemptions == 0


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    caching=st.booleans(),
    num_blocks=st.integers(6, 16),
    budget=st.integers(8, 40),
    max_num_seqs=st.integers(1, 6),
)
def test_random_traffic_completes_without_leaks(
    data: st.DataObject,
    mode: str,
    chunked: bool,
    caching: bool,
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
) -> None:
    sched, model = make_scheduler(
        num_blocks=num_blocks,
        num_cpu_blocks=data.draw(st.integers(0, 12)),
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        preemption_mode=mode,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
    )
    shared = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=12))
    pending = []
    for i in range(data.draw(st.integers(1, 14))):
        tail = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20))
        prompt = (shared if data.draw(st.booleans()) else []) + tail
        max_tokens = data.draw(st.integers(1, 24))
        try:
            sched.check_fits(len(prompt), max_tokens)
        except ParameterError:
            continue
        arrive_at = data.draw(st.integers(0, 10))
        abort_at = data.draw(st.one_of(st.none(), st.integers(0, 30)))
        pending.append((arrive_at, abort_at, f"r{i}", prompt, max_tokens))
    reqs: dict[str, Request] = {}
    aborted = set()
    swapped = False
    for t in range(2000):
        for arrive_at, abort_at, rid, prompt, max_tokens in pending:
            if arrive_at == t:
                reqs[rid] = add(sched, rid, prompt, max_tokens=max_tokens, arrival_time=t)
            if abort_at == t and rid in reqs and not reqs[rid].is_finished:
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if t > 10 and not sched.has_unfinished():
            break
        out, _ = step(sched, model)
        swapped = swapped or bool(out.swap_out)
    else:
        raise AssertionError("livelock: requests never finished")
    event(f"preempted: {sched.stats.num_preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"swapped: {swapped}")
    assert_no_leaks(sched)
    for rid, req in reqs.items():
        if rid in aborted:
            assert req.finish_reason == "abort"
        else:
            want = reference_output(req.prompt_token_ids, req.sampling_params.max_tokens or 0)
            assert req.output_token_ids == want and req.finish_reason == "length"


def test_pressure_forces_preemptions_and_everything_still_completes() -> None:
    for mode in ("recompute", "swap"):
        sched, model = make_scheduler(
            num_blocks=12, num_cpu_blocks=6, max_num_batched_tokens=16, preemption_mode=mode
        )
        reqs = [
            add(sched, f"r{i}", [(i * 5 + j) % 40 + 1 for j in range(6 + i)], max_tokens=14)
            for i in range(8)
        ]
        run_all(sched, model)
        assert sched.stats.num_preemptions > 0
        for r in reqs:
            assert r.output_token_ids == reference_output(r.prompt_token_ids, 14)
        assert_no_leaks(sched)
