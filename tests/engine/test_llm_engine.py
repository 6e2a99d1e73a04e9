"""LLMEngine end to end on a tiny random Llama (real loader, scheduler, runner, sampler):
bad input, block accounting, prefix cache counters, seeds, n > 1, stops, streaming."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import ParameterError, SamplingParams
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_no_blocks_held(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(b.ref_cnt == 0 for b in engine.scheduler.kv.pool.blocks)
    assert not engine.has_unfinished()


def prompt(n: int, start: int = 100) -> list[int]:
    return [(start + 7 * i) % 4000 + 10 for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("tokens", "params", "param"),
    [
        ([], GREEDY, "prompt"),
        ([5, 10**7], GREEDY, "prompt"),
        ([5, -1], GREEDY, "prompt"),
        (prompt(300), GREEDY, "prompt"),  # longer than max_model_len
        (prompt(200), SamplingParams(max_tokens=100), "max_tokens"),  # beyond the context
        (prompt(10), SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        (prompt(10), SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        (prompt(10), SamplingParams(n=2, pooling=PoolingParams()), "pooling"),
    ],
)
def test_bad_input_raises_naming_the_parameter_and_allocates_nothing(
    tiny: LoadedModel, tokens: list[int], params: SamplingParams, param: str
) -> None:
    engine = make_engine(tiny, max_model_len=256)
    with pytest.raises(ParameterError) as info:
        engine.add_request("bad", tokens, params)
    assert info.value.param == param
    assert param.split("_")[0] in str(info.value)
    assert_no_blocks_held(engine)
    assert engine.stats().num_prompt_tokens == 0


def test_request_that_can_never_fit_the_pool_is_refused(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, num_gpu_blocks_override=4)  # 64 tokens of KV
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("big", prompt(50), SamplingParams(max_tokens=40))
    assert_no_blocks_held(engine)


def test_duplicate_request_id_is_refused(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request("a", prompt(5), GREEDY)
    with pytest.raises(ParameterError) as info:
        engine.add_request("a", prompt(5), GREEDY)
    assert info.value.param == "request_id"
    assert len(run_all(engine)) == 1
    assert_no_blocks_held(engine)


def test_failed_batch_in_llm_generate_leaves_nothing_queued(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny, max_model_len=256))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt(5), prompt(6), []], GREEDY)
    assert_no_blocks_held(llm.engine)


# ----------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_block_leaks_after_finished_aborted_and_preempted(tiny: LoadedModel, mode: str) -> None:
    engine = make_engine(tiny, num_gpu_blocks_override=24, preemption_mode=mode)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(10):
        engine.add_request(f"r{i}", prompt(30 + i, start=i * 50), params)
    finals: dict[str, RequestOutput] = {}
    for step in range(12):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if step == 5:
            for rid in ("r0", "r9", "r4"):  # running and waiting ones
                aborted = engine.abort(rid)
                assert aborted is not None and aborted.finished
                finals[rid] = aborted
    finals.update(run_all(engine))
    assert engine.stats().num_preemptions > 0
    assert sorted(finals) == sorted(f"r{i}" for i in range(10))
    for rid, out in finals.items():
        reason = out.outputs[0].finish_reason
        assert reason == ("abort" if rid in ("r0", "r9", "r4") else "length")
        if reason == "length":
            assert len(out.outputs[0].token_ids) == 40
    assert engine.abort("r1") is None  # finished: nothing to abort
    assert_no_blocks_held(engine)


def test_preempted_request_resumes_with_same_output(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt(30 + i, start=i * 50) for i in range(8)]
    roomy = LLM.from_engine(make_engine(tiny)).generate(prompts, params)
    for mode in ("recompute", "swap"):
        engine = make_engine(tiny, num_gpu_blocks_override=20, preemption_mode=mode)
        tight = LLM.from_engine(engine).generate(prompts, params)
        assert engine.stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
        assert sum(o.metrics.num_preemptions for o in tight) > 0
        assert_no_blocks_held(engine)


# ----------------------------------------------------------------------------- prefix cache


def test_shared_400_token_prefix_computes_only_new_tokens(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, max_num_batched_tokens=512)
    prefix = prompt(400, start=3)
    first = prefix + prompt(9, start=1000)
    engine.add_request("first", first, GREEDY)
    run_all(engine)
    before = engine.stats()
    assert before.num_computed_prompt_tokens == len(first)

    second = prefix + prompt(23, start=2000)
    engine.add_request("second", second, GREEDY)
    out = run_all(engine)["second"]
    after = engine.stats()
    assert out.num_cached_tokens == 400  # 25 full blocks of 16
    assert after.num_computed_prompt_tokens - before.num_computed_prompt_tokens == 23
    assert after.prefix_cache_hits - before.prefix_cache_hits == 400

    engine.add_request("other-tenant", second, GREEDY, cache_salt="tenant-b")
    assert run_all(engine)["other-tenant"].num_cached_tokens == 0
    assert_no_blocks_held(engine)


def test_prefix_caching_off_computes_everything(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, enable_prefix_caching=False)
    p = prompt(100)
    for rid in ("a", "b"):
        engine.add_request(rid, p, GREEDY)
        assert run_all(engine)[rid].num_cached_tokens == 0
    assert engine.stats().num_computed_prompt_tokens == 200


# ----------------------------------------------------------------------------- sampling


def test_seed_reproduces_the_same_text_whatever_the_batch(tiny: LoadedModel) -> None:
    seeded = SamplingParams(temperature=5.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    llm = LLM.from_engine(make_engine(tiny))
    alone = llm.generate([prompt(12)], seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        [prompt(30, start=9), prompt(12), prompt(5, start=77), prompt(50, start=5)],
        [noisy, seeded, noisy, noisy],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt(12)], SamplingParams(**{**vars(seeded), "seed": 7}))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_children_share_the_prompt_and_differ(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=5.0, seed=5, max_tokens=12, ignore_eos=True)
    out = LLM.from_engine(engine).generate([prompt(40)], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # The prompt's 2 full blocks were computed once; each sibling computed only the rest.
    assert out.num_cached_tokens == 32
    assert engine.stats().num_computed_prompt_tokens == 40 + 2 * (40 - 32)
    texts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(texts)) == 3
    assert all(len(t) == 12 for t in texts)
    again = LLM.from_engine(make_engine(tiny)).generate([prompt(40)], params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == texts
    assert_no_blocks_held(engine)


def test_aborting_a_parent_ends_all_its_children(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True)
    engine.add_request("fan", prompt(40), params)
    engine.step()
    out = engine.abort("fan")
    assert out is not None and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert_no_blocks_held(engine)


def test_logprobs_are_reported_for_each_token(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    completion = llm.generate([prompt(10)], params)[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    for token, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert lp.token_id == token
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token  # greedy: the chosen token is the best
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][1])


# ----------------------------------------------------------------------------- stops, text


def test_stop_string_ends_the_request_and_is_excluded(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny))
    free = llm.generate(
        [prompt(10)], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0].outputs[0]
    assert len(free.text) > 12
    stop = free.text[6:11]
    cut = free.text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate([prompt(10)], params)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (free.text[:cut], "stop", stop)
    assert len(out.token_ids) < 24
    kept = llm.generate(
        [prompt(10)],
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert kept.text == free.text[: cut + len(stop)]
    late = llm.generate(
        [prompt(10)],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=20),
    )[0].outputs[0]
    assert len(late.token_ids) >= 20  # stop strings wait for min_tokens, as in vLLM
    assert_no_blocks_held(llm.engine)


def test_stop_token_id_and_max_tokens_finish_reasons(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny))
    free = llm.generate(
        [prompt(10)], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0]
    assert (len(free.token_ids), free.finish_reason) == (10, "length")
    stop_token = free.token_ids[4]
    first = free.token_ids.index(stop_token)
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_token]
    )
    out = llm.generate([prompt(10)], params)[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)


def test_streamed_deltas_add_up_to_the_final_output(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request(
        "s",
        prompt(20),
        SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True, stop=["zz"]),
    )
    text, tokens, last = "", [], None
    while engine.has_unfinished():
        for out in engine.step():
            c = out.outputs[0]
            text += c.text_delta
            tokens += c.token_ids_delta
            assert c.text == text and c.token_ids == tokens
            last = out
    assert last is not None and last.finished
    m = last.metrics
    assert m.first_token_time is not None and m.last_token_time is not None
    assert m.finished_time is not None and m.first_scheduled_time is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time
    assert m.last_token_time <= m.finished_time


def test_chat_uses_the_chat_template(tiny: LoadedModel) -> None:
    llm = LLM.from_engine(make_engine(tiny))
    convo = [{"role": "user", "content": "Hello!"}]
    out = llm.chat(convo, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    expected = llm.tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.decode(out[0].prompt_token_ids) == expected
    both = llm.chat([convo, convo], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(both) == 2 and both[0].outputs[0].token_ids == both[1].outputs[0].token_ids


def test_stats_count_steps_tokens_and_finishes(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    engine.add_request("a", prompt(10), GREEDY)
    engine.add_request("b", prompt(12), GREEDY)
    engine.step()
    engine.abort("b")
    run_all(engine)
    s = engine.stats()
    assert s.num_prompt_tokens == 22
    assert s.num_generation_tokens >= 8
    assert (s.finished_length, s.finished_abort, s.finished_stop) == (1, 1, 0)
    assert s.num_steps >= 8
