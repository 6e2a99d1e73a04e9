"""--async-scheduling: step N+1 is scheduled and launched before step N's ids are read.

On the CPU the model call is synchronous, but the order and the bookkeeping (placeholders,
counts advanced at launch, stops learned one step late, discarded rows) are the code a GPU
runs. Each test compares the asynchronous engine with the synchronous one on the tiny random
model: greedy and seeded tokens, finish reasons and text must be identical.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.async_scheduler import AsyncScheduler
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_cuda_graphs import _with_graph_buffers
from tests.engine.test_llm_engine import assert_no_blocks_held
from tests.engine.test_structured_output import SCHEMA
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=2
)
TWO_SEEDED = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, ignore_eos=True)


def summary(finals: dict[str, RequestOutput]) -> dict[str, list[tuple[Any, ...]]]:
    """What must not change: per completion its tokens, finish, stop reason and text, and the
    token ids of its logprobs. Their values are compared apart (:func:`assert_same_logprobs`):
    a step's batch differs (a request that stopped still has a row in the next step), and a
    float32 logit on this CPU may move in its last bits with the batch."""
    return {
        rid: [
            (c.token_ids, c.finish_reason, c.stop_reason, c.text,
             None if c.logprobs is None else [(lp.token_id, [t for t, _ in lp.top_logprobs])
                                              for lp in c.logprobs])
            for c in out.outputs
        ]
        for rid, out in finals.items()
    }  # fmt: skip


def logprob_values(finals: dict[str, RequestOutput]) -> list[float]:
    return [
        v
        for out in finals.values()
        for c in out.outputs
        for lp in c.logprobs or ()
        for v in (lp.logprob, *(x for _, x in lp.top_logprobs))
    ]


def shared_prefix_prompts(num: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, 1000, (24,), generator=gen).tolist()
    return [
        prefix + torch.randint(0, 1000, (3 + 4 * i,), generator=gen).tolist() for i in range(num)
    ]


def run(
    loaded: LoadedModel, requests: list[tuple[list[int], SamplingParams]], **config: Any
) -> tuple[dict[str, list[tuple[Any, ...]]], LLMEngine]:
    engine, finals = run_finals(loaded, requests, **config)
    return summary(finals), engine


def run_finals(
    loaded: LoadedModel, requests: list[tuple[list[int], SamplingParams]], **config: Any
) -> tuple[LLMEngine, dict[str, RequestOutput]]:
    engine = make_engine(loaded, **config)
    for i, (tokens, params) in enumerate(requests):
        engine.add_request(f"r{i}", tokens, params)
    return engine, run_all(engine)


def record_steps(engine: LLMEngine) -> list[list[tuple[str, int]]]:
    """Every plan the engine's scheduler makes, as (request id, tokens) lists."""
    steps: list[list[tuple[str, int]]] = []
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        steps.append([(r.request_id, n) for r, n in out.scheduled])
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_gives_the_synchronous_tokens_with_preemption_a_cached_prefix_and_mixed_steps(
    tiny: LoadedModel, mode: str
) -> None:
    prompts = shared_prefix_prompts()
    params = [GREEDY, SEEDED, TWO_SEEDED]
    requests = [(p, params[i % 3]) for i, p in enumerate(prompts)]
    # 18 blocks of 4 tokens cannot hold all six; a 16-token budget chunks the prompts
    config = dict(num_gpu_blocks_override=18, max_num_seqs=8, block_size=4,
                  max_num_batched_tokens=16, preemption_mode=mode)  # fmt: skip
    sync_engine, sync_finals = run_finals(tiny, requests, **config)
    engine = make_engine(tiny, async_scheduling=True, **config)
    steps = record_steps(engine)
    for i, (tokens, p) in enumerate(requests):
        engine.add_request(f"r{i}", tokens, p)
    finals = run_all(engine)
    assert summary(finals) == summary(sync_finals)
    values, expected_values = logprob_values(finals), logprob_values(sync_finals)
    assert len(values) > 50
    assert values == pytest.approx(expected_values, abs=1e-4)
    assert isinstance(engine.scheduler, AsyncScheduler) and engine._async is not None
    assert engine._async.num_async_steps > 0 and engine._async.num_sync_steps == 0
    stats = engine.stats()
    assert stats.num_preemptions > 0 and sync_engine.stats().num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    # a step that decodes some requests and prefills a chunk of another
    assert any(any(n == 1 for _, n in step) and any(n > 1 for _, n in step) for step in steps)
    assert_no_blocks_held(engine)
    assert all(r.num_output_placeholders == 0 for r in engine.scheduler.requests.values())


def test_async_on_the_graph_buffers_resolves_placeholders_through_them(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode graphs' buffers (CPU, no capture) take each placeholder row's token from the
    previous step's ids (``DecodeStep.from_sampled``): tokens equal the eager sync engine's."""
    requests = [(p, [GREEDY, SEEDED][i % 2]) for i, p in enumerate(shared_prefix_prompts())]
    config = dict(num_gpu_blocks_override=18, max_num_seqs=8, block_size=4)
    expected, _ = run(tiny, requests, **config)
    engine = make_engine(tiny, async_scheduling=True, **config)
    buckets = _with_graph_buffers(engine, monkeypatch)
    loads: list[bool] = []
    load = engine.runner.graphs.buffers.load  # type: ignore[union-attr]

    def loading(step: Any, bucket: int, sampled: Any = None) -> None:
        loads.append(step.from_sampled is not None and sampled is not None)
        load(step, bucket, sampled)

    monkeypatch.setattr(engine.runner.graphs.buffers, "load", loading)  # type: ignore[union-attr]
    for i, (tokens, p) in enumerate(requests):
        engine.add_request(f"r{i}", tokens, p)
    assert summary(run_all(engine)) == expected
    assert buckets and sum(loads) > 10  # graph steps fed from the device ids
    assert engine.stats().num_preemptions > 0
    assert_no_blocks_held(engine)


def test_stops_learned_a_step_late_finish_exactly_as_the_synchronous_engine(
    tiny: LoadedModel,
) -> None:
    prompts = shared_prefix_prompts(5)
    free, _ = run(tiny, [(p, GREEDY) for p in prompts])
    tokens = [free[f"r{i}"][0][0] for i in range(5)]
    text = free["r3"][0][3]
    # the model's EOS made a token that request 0 generates as its 4th
    eos = tokens[0][3]
    loaded = dataclasses.replace(
        tiny, config=dataclasses.replace(tiny.config, eos_token_ids=(eos,))
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=16),  # EOS
        SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[tokens[1][5]]
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # max_tokens
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            ignore_eos=True,
            stop=[text[len(text) // 2 : len(text) // 2 + 3]],
        ),  # fmt: skip
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10),  # EOS banned a while
    ]
    requests = list(zip(prompts, params, strict=True))
    expected, _ = run(loaded, requests)
    got, engine = run(loaded, requests, async_scheduling=True)
    assert got == expected
    finishes = {rid: (c[0][1], c[0][2]) for rid, c in got.items()}
    assert finishes["r0"] == ("stop", None) and len(got["r0"][0][0]) < 16
    assert finishes["r1"] == ("stop", tokens[1][5])
    assert finishes["r2"] == ("length", None)
    assert finishes["r3"][0] == "stop" and isinstance(finishes["r3"][1], str)
    assert engine._async is not None and engine._async.num_discarded_rows > 0
    assert engine._async.num_sync_steps == 0
    assert_no_blocks_held(engine)


def test_an_abort_mid_flight_frees_its_blocks_and_leaves_the_others_unchanged(
    tiny: LoadedModel,
) -> None:
    requests = [(p, GREEDY) for p in shared_prefix_prompts(3)]
    expected, _ = run(tiny, requests)
    engine = make_engine(tiny, async_scheduling=True)
    for i, (tokens, p) in enumerate(requests):
        engine.add_request(f"r{i}", tokens, p)
    for _ in range(4):
        engine.step()
    assert engine._async is not None and engine._async.in_flight is not None
    in_flight = {r.request_id for r in engine._async.in_flight.rows}
    assert "r1" in in_flight
    aborted = engine.abort("r1")
    assert aborted is not None and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    partial = aborted.outputs[0].token_ids
    assert 0 < len(partial) < 16 and partial == expected["r1"][0][0][: len(partial)]
    got = summary(run_all(engine))
    assert got == {rid: expected[rid] for rid in ("r0", "r2")}
    assert engine._async.num_discarded_rows >= 1
    assert_no_blocks_held(engine)


def test_the_schedule_is_the_synchronous_one_step_by_step(tiny: LoadedModel) -> None:
    """With finishes known in advance (max_tokens) and room for every request, asynchronous
    scheduling plans exactly the synchronous engine's steps: the placeholders stand in for
    the tokens, and no request is scheduled past its end."""
    prompts = shared_prefix_prompts()
    requests = [
        (p, dataclasses.replace(GREEDY, max_tokens=5 + 3 * i)) for i, p in enumerate(prompts)
    ]
    plans = []
    for flag in (False, True):
        engine = make_engine(tiny, async_scheduling=flag, max_num_batched_tokens=32)
        steps = record_steps(engine)
        for i, (tokens, p) in enumerate(requests):
            engine.add_request(f"r{i}", tokens, p)
        run_all(engine)
        plans.append([s for s in steps if s])
    assert plans[0] == plans[1]
    assert len(plans[0]) > 20


def test_embeddings_and_prompt_logprobs_beside_generation_equal_the_synchronous_engine(
    tiny: LoadedModel,
) -> None:
    """Requests that read their prompt's hidden states (the runner reads them in the step,
    chunk by chunk) next to generations, through chunked prefills."""
    prompts = shared_prefix_prompts(4)
    embed = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams("MEAN"))
    requests = [
        (prompts[0], GREEDY),
        (prompts[1], embed),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)),
        (prompts[3], SEEDED),
    ]
    results = []
    for flag in (False, True):
        engine = make_engine(tiny, async_scheduling=flag, max_num_batched_tokens=8)
        for i, (tokens, p) in enumerate(requests):
            engine.add_request(f"r{i}", tokens, p)
        finals, delivered = {}, []
        while engine.has_unfinished():  # prompt logprobs come once, on an output before the last
            for out in engine.step():
                delivered += [out.prompt_logprobs] if out.prompt_logprobs is not None else []
                if out.finished:
                    finals[out.request_id] = out
        results.append((summary(finals), finals, delivered))
        assert_no_blocks_held(engine)
    (expected, sync_finals, [want_read]), (got, finals, [read]) = results
    assert got == expected
    vector, want = finals["r1"].embedding, sync_finals["r1"].embedding
    assert vector is not None and want is not None
    torch.testing.assert_close(torch.tensor(vector), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert len(read) == len(want_read) == len(prompts[2])
    for a, b in zip(read[1:], want_read[1:], strict=True):
        assert a is not None and b is not None and a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


NGRAM = {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "disable_by_batch_size": None,
}  # fmt: skip


@pytest.mark.parametrize("case", ["penalties", "structured", "speculation"])
def test_steps_that_need_the_tokens_on_the_host_fall_back_to_synchronous(
    tiny: LoadedModel, case: str
) -> None:
    prompts = shared_prefix_prompts(4)
    special = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3)
    config: dict[str, Any] = {}
    if case == "structured":
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        special = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=spec)
    if case == "speculation":
        config["speculative_config"] = NGRAM
        special = GREEDY
    requests = [(prompts[0], special)] + [(p, GREEDY) for p in prompts[1:]]
    expected, _ = run(tiny, requests, **config)
    got, engine = run(tiny, requests, async_scheduling=True, **config)
    assert got == expected
    assert engine._async is not None and engine._async.num_sync_steps > 0
    if case == "speculation":  # the proposer reads every step's tokens: all synchronous
        assert engine._async.num_async_steps == 0
        assert engine.speculation is not None and engine.speculation.stats.num_drafts > 0
    else:  # the special request ends first; the others go on asynchronously
        assert engine._async.num_async_steps > 0
    assert not engine.scheduler.host_bound  # type: ignore[attr-defined]
    assert_no_blocks_held(engine)


def test_refusals_and_the_flag(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="--async-scheduling is not supported with --tensor"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    engine = make_engine(tiny, async_scheduling=True)
    engine.add_request("r", shared_prefix_prompts(1)[0], GREEDY)
    engine.step()  # the prefill is launched; its token is a placeholder until read
    req = engine.scheduler.requests["r"]
    assert req.num_output_placeholders == 1 and req.num_output_tokens == 0
    out = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="placeholder input token without the step"):
        engine.runner.execute(out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_async_on_cuda_gives_the_synchronous_greedy_and_seeded_tokens(
    tiny_llama_dir: Path, eager: bool
) -> None:
    """On a GPU (float32: exact): with and without CUDA graphs, every bucket of
    --max-num-seqs 5 visited, preemption and a cached prefix."""
    from engine.model_loader import load_model
    from portico.registry import resolve

    loaded = load_model(resolve(str(tiny_llama_dir)), torch.float32, torch.device("cuda"))
    requests = [(p, [GREEDY, SEEDED][i % 2]) for i, p in enumerate(shared_prefix_prompts())]
    config = dict(device="cuda", num_gpu_blocks_override=18, max_num_seqs=5, block_size=4,
                  enforce_eager=eager)  # fmt: skip
    expected, _ = run(loaded, requests, **config)
    got, engine = run(loaded, requests, async_scheduling=True, **config)
    assert got == expected
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0
    assert (engine.runner.graphs is None) == eager
    if engine.runner.graphs is not None:  # step N+1's staging never overwrites step N's
        assert engine.runner.graphs.buffers.staging_sets == 2
    assert_no_blocks_held(engine)
