"""AsyncLLMEngine on a tiny random Llama: streams, concurrency, abort on leave, health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.outputs import RequestOutput
from engine.sampling_params import ParameterError, SamplingParams
from portico.registry import ModelSource

# Long enough that the abort of a test always lands first, however slow the machine: close to
# the tiny model's 1,024 positions (a request cannot finish before the engine thread has run
# ~960 steps, while the abort needs one turn of the event loop).
LONG = SamplingParams(temperature=0.0, max_tokens=960, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(ModelSource("tiny", tiny_llama_dir, "hf"), torch.float32, "cpu")


def make_engine(tiny: LoadedModel) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", device="cpu", num_gpu_blocks_override=128), tiny)


@pytest.fixture
async def engine(tiny: LoadedModel) -> AsyncIterator[AsyncLLMEngine]:
    async_engine = AsyncLLMEngine(make_engine(tiny))
    await async_engine.start()
    yield async_engine
    await async_engine.shutdown()


def prompt(n: int, start: int = 100) -> list[int]:
    return [(start + 7 * i) % 4000 + 10 for i in range(n)]


async def collect(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in stream]


async def wait_idle(engine: AsyncLLMEngine) -> None:
    """Wait until the engine thread has freed every block (polled; the bound only stops a
    broken engine from hanging the suite, it is no speed requirement)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine never went idle: {engine.stats()}")


async def test_concurrent_streams_match_the_sync_engine(
    engine: AsyncLLMEngine, tiny: LoadedModel
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [prompt(5 + 3 * i, start=40 * i) for i in range(6)]
    expected = LLM.from_engine(make_engine(tiny)).generate(prompts, params)
    results = await asyncio.gather(
        *(collect(engine.generate(f"r{i}", p, params)) for i, p in enumerate(prompts))
    )
    for outs, ref in zip(results, expected, strict=True):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert "".join(o.outputs[0].text_delta for o in outs) == ref.outputs[0].text
    await wait_idle(engine)
    assert engine.num_unfinished == 0


async def test_leaving_the_stream_aborts_and_frees_blocks(engine: AsyncLLMEngine) -> None:
    stream = engine.generate("leaver", prompt(30), LONG)
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()  # what `async with aclosing(...)` / a disconnect does
    await wait_idle(engine)
    assert engine.stats().finished_abort == 1
    assert engine.num_unfinished == 0


async def test_an_id_reused_right_after_leaving_gets_its_own_output(
    engine: AsyncLLMEngine,
) -> None:
    stream = engine.generate("same", prompt(30), LONG)
    await stream.__anext__()
    await stream.aclose()  # abort queued, not yet applied by the engine thread
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = await collect(engine.generate("same", prompt(8), params))
    final = outs[-1].outputs[0]
    assert (final.finish_reason, len(final.token_ids)) == ("length", 5)
    assert outs[-1].prompt_token_ids == prompt(8)
    await wait_idle(engine)


async def test_cancelled_consumer_aborts_the_request(engine: AsyncLLMEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancelled", prompt(30), LONG):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_idle(engine)
    assert engine.stats().finished_abort == 1


async def test_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncLLMEngine) -> None:
    stream = engine.generate("victim", prompt(20), LONG)
    first = await stream.__anext__()
    assert not first.finished
    await engine.abort("victim")
    rest = [out async for out in stream]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < LONG.max_tokens
    await wait_idle(engine)


async def test_bad_input_raises_at_call_and_queues_nothing(engine: AsyncLLMEngine) -> None:
    with pytest.raises(ParameterError) as info:
        engine.generate("bad", [], LONG)
    assert info.value.param == "prompt"
    with pytest.raises(ParameterError) as info:
        engine.generate("bad", [10**8], LONG)
    assert info.value.param == "prompt"
    assert engine.num_unfinished == 0
    stream = engine.generate("dup", prompt(10), LONG)
    with pytest.raises(ValueError, match="request_id"):
        engine.generate("dup", prompt(10), LONG)
    await engine.abort("dup")
    await collect(stream)
    await wait_idle(engine)


async def test_event_loop_stays_responsive_while_generating(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    outs = await collect(engine.generate("busy", prompt(50), params))
    done.set()
    await tick_task
    # The loop interleaved many other tasks with the engine's 60 steps.
    assert ticks > len(outs)


async def test_health_fields_and_shutdown(tiny: LoadedModel) -> None:
    engine = AsyncLLMEngine(make_engine(tiny))
    with pytest.raises(RuntimeError, match="start"):
        engine.generate("early", prompt(5), LONG)
    await engine.start()
    assert engine.is_alive
    before = engine.last_progress
    await collect(engine.generate("one", prompt(5), SamplingParams(max_tokens=4)))
    assert engine.last_progress > before
    stream = engine.generate("pending", prompt(5), LONG)
    await stream.__anext__()
    await engine.shutdown()
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        engine.generate("late", prompt(5), LONG)
