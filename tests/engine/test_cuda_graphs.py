"""CUDA graphs for decode steps (engine/cuda_graphs.py).

On CPU: the bucket plan, the fallback decisions, the persistent buffers' padding, and the
model runner's graph hook driven with the same buffers and no capture (the padded step gives
the real rows the logits and tokens of the plain eager step, and the padding writes only the
scratch block). On a CUDA GPU (``gpu`` marker): capture and replay give the eager greedy tokens
at every bucket size.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import model_runner as model_runner_module
from engine.config import EngineConfig
from engine.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    DecodeStep,
    bucket_for,
    fallback_reason,
    plan_buckets,
)
from engine.model_loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

# The two cores are shared: one intra-op thread (see conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
NUM_BLOCKS = 40  # the scheduler's pool: blocks 0..39; block 40 is the graphs' scratch block


def test_bucket_plan_follows_vllm_sizes_up_to_max_num_seqs() -> None:
    assert plan_buckets(1) == [1]
    assert plan_buckets(8) == [1, 2, 4, 8]
    assert plan_buckets(20) == [1, 2, 4, 8, 16, 20]
    big = plan_buckets(256)
    assert big[:7] == [1, 2, 4, 8, 16, 24, 32] and big[-1] == 256 and len(big) == 35
    with pytest.raises(ValueError, match="max_num_seqs"):
        plan_buckets(0)


@pytest.mark.parametrize(
    ("max_num_seqs", "n", "bucket"),
    [(20, 1, 1), (20, 3, 4), (20, 8, 8), (20, 9, 16), (20, 17, 20), (32, 17, 24), (32, 25, 32)],
)
def test_a_batch_takes_the_smallest_bucket_that_holds_it(
    max_num_seqs: int, n: int, bucket: int
) -> None:
    assert bucket_for(plan_buckets(max_num_seqs), n) == bucket


def test_a_batch_beyond_the_largest_bucket_has_none() -> None:
    assert bucket_for(plan_buckets(20), 21) is None


def _reason(**overrides: Any) -> str | None:
    kw: dict[str, Any] = dict(
        device_type="cuda", enforce_eager=False, query_lens=[1, 1, 1], num_sampled=3,
        has_guesses=False, has_lora_rows=False, max_bucket=8,
    )  # fmt: skip
    return fallback_reason(**(kw | overrides))


def test_pure_decode_steps_on_cuda_take_the_graph() -> None:
    assert _reason() is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"device_type": "cpu"}, "not a CUDA device"),
        ({"enforce_eager": True}, "--enforce-eager"),
        ({"query_lens": [1, 5, 1]}, "not a pure decode step"),  # mixed prefill + decode
        ({"query_lens": [1, 1, 1], "num_sampled": 2}, "not a pure decode step"),  # a 1-token chunk
        ({"has_guesses": True}, "speculative guesses"),
        ({"has_lora_rows": True}, "a LoRA adapter row"),
        ({"query_lens": [1] * 9, "num_sampled": 9}, "more requests than the largest bucket"),
    ],
)
def test_steps_graphs_do_not_cover_fall_back_to_eager(overrides: dict, reason: str) -> None:
    assert _reason(**overrides) == reason


def test_buffers_pad_rows_to_the_scratch_block_and_keep_real_rows() -> None:
    buffers = DecodeBuffers(8, 6, BLOCK_SIZE, scratch_block=40, device=torch.device("cpu"))
    buffers.load(DecodeStep([11, 12, 13], [4, 9, 0], [5, 10, 1], [[7, 3], [2, 5, 8], [6]]), 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 9, 0, 0]
    # slot of position p: table[p // 4] * 4 + p % 4; the padding row's is the scratch block's
    assert buffers.slot_mapping[:4].tolist() == [3 * 4 + 0, 8 * 4 + 1, 6 * 4 + 0, 40 * 4]
    assert buffers.seq_lens[:4].tolist() == [5, 10, 1, 1]
    assert buffers.block_tables[:4, :3].tolist() == [[7, 3, 40], [2, 5, 8], [6, 40, 40], [40] * 3]
    meta = buffers.metadata(4)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.query_lens_cpu == [1] * 4
    assert meta.seq_lens_cpu == [5, 10, 1, 1] and meta.max_seq_len == 10
    # A smaller step reuses the same tensors: its rows and padding overwrite what it reads.
    ids = buffers.input_ids
    buffers.load(DecodeStep([21], [2], [3], [[9, 4, 1]]), 2)  # blocks past the context: unread
    assert buffers.input_ids is ids
    assert buffers.input_ids[:2].tolist() == [21, 0]
    assert buffers.slot_mapping[:2].tolist() == [9 * 4 + 2, 40 * 4]
    assert buffers.block_tables[:2, :1].tolist() == [[9], [40]]
    assert buffers.block_tables[0, 1:3].tolist() == [3, 40]  # stale, past the context: unread


def test_buffers_refuse_a_step_larger_than_its_bucket() -> None:
    buffers = DecodeBuffers(4, 2, BLOCK_SIZE, scratch_block=9, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        buffers.load(DecodeStep([1, 2, 3], [0, 0, 0], [1, 1, 1], [[0], [1], [2]]), 2)
    with pytest.raises(ValueError, match="do not fit"):
        buffers.load(DecodeStep([1], [0], [1], [[0]]), 8)


def test_enforce_eager_is_a_flag_and_cpu_runners_have_no_graphs(
    tiny: LoadedModel, tiny_llama_dir: Path
) -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args([]).enforce_eager is False
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    runner = ModelRunner(tiny, EngineConfig(model=str(tiny_llama_dir)), num_gpu_blocks=4)
    assert runner.graphs is None and runner.kv_caches[0].shape[1] == 4  # no scratch block


def _requests(vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    return [
        Request(name, torch.randint(0, vocab, (n,), generator=gen).tolist(), SamplingParams())
        for name, n in (("a", 9), ("b", 14), ("c", 3), ("d", 7), ("e", 5))
    ]


def _tables(requests: list[Request], max_new: int) -> dict[str, list[int]]:
    pool = list(range(NUM_BLOCKS))
    random.Random(2).shuffle(pool)
    tables = {}
    for req in requests:
        need = -(-(req.num_tokens + max_new) // BLOCK_SIZE)
        tables[req.request_id], pool = pool[:need], pool[need:]
    return tables


def _run(runner: ModelRunner, steps: list[list[tuple[str, int]]], vocab: int) -> list[Any]:
    """Drive ``runner`` through ``steps`` (request name, new tokens) greedily; returns each
    step's logits and the final token lists."""
    reqs = {r.request_id: r for r in _requests(vocab)}
    tables = _tables(list(reqs.values()), max_new=8)
    logits_per_step = []
    for step in steps:
        scheduled = [(reqs[name], n) for name, n in step]
        sampled, logits = runner.execute(SchedulerOutput(scheduled=scheduled, block_tables=tables))
        logits_per_step.append(logits.clone())
        for req, n in scheduled:
            req.num_computed_tokens += n
        for req, row in zip(sampled, logits, strict=True):
            req.append_output_token(int(row.argmax()))
    return [logits_per_step, {name: r.all_token_ids for name, r in reqs.items()}]


# Prefill (eager in both runners), then decodes of 5, 3 and 1 requests: buckets 8, 4 and 1,
# so padding rows of 3 and 1, and a bucket reused after a larger one; a mixed step between.
STEPS = [
    [("a", 9), ("b", 14), ("c", 3), ("d", 7), ("e", 5)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],
    [("a", 1), ("b", 1), ("c", 1)],
    [("d", 1), ("e", 1), ("a", 1), ("b", 1), ("c", 1)],
    [("b", 1)],
    [("c", 1), ("d", 1), ("e", 1)],
]


def test_padded_decode_steps_through_the_runner_equal_eager_steps(
    tiny: LoadedModel, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK_SIZE, max_num_seqs=8)
    vocab = tiny.config.vocab_size
    eager = ModelRunner(tiny, config, num_gpu_blocks=NUM_BLOCKS + 1)
    graphed = ModelRunner(tiny, config, num_gpu_blocks=NUM_BLOCKS + 1)
    buffers = DecodeBuffers(8, 8, BLOCK_SIZE, scratch_block=NUM_BLOCKS, device=tiny.device)
    graphed.graphs = DecodeGraphs(tiny.model, graphed.kv_caches, buffers, plan_buckets(8))
    # The CUDA decision on CPU: decode steps take the graph runner's buffers (not captured:
    # the same padded step runs eagerly), prefill steps the eager path.
    real_reason = model_runner_module.fallback_reason
    monkeypatch.setattr(
        model_runner_module, "fallback_reason",
        lambda **kw: real_reason(**(kw | {"device_type": "cuda"})),
    )  # fmt: skip
    buckets_run: list[int] = []
    load = buffers.load
    monkeypatch.setattr(buffers, "load", lambda s, b: (buckets_run.append(b), load(s, b))[1])

    eager_logits, eager_tokens = _run(eager, STEPS, vocab)
    graph_logits, graph_tokens = _run(graphed, STEPS, vocab)

    assert buckets_run == [8, 4, 8, 1, 4]  # every decode step went through the buffers
    assert graph_tokens == eager_tokens
    for step, (a, b) in enumerate(zip(eager_logits, graph_logits, strict=True)):
        assert a.shape == b.shape, step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    for e, g in zip(eager.kv_caches, graphed.kv_caches, strict=True):
        # Real blocks hold the same K/V; only the scratch block took the padding rows' writes.
        torch.testing.assert_close(e[:, :NUM_BLOCKS], g[:, :NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        assert not e[:, NUM_BLOCKS].any() and g[:, NUM_BLOCKS].any()


def test_a_step_beyond_the_largest_bucket_is_refused_by_the_graph_runner(
    tiny: LoadedModel,
) -> None:
    buffers = DecodeBuffers(2, 4, BLOCK_SIZE, scratch_block=9, device=tiny.device)
    kv = [torch.zeros(2, 10, BLOCK_SIZE, 2, 16) for _ in range(2)]
    graphs = DecodeGraphs(tiny.model, kv, buffers, [1, 2])
    with pytest.raises(ValueError, match="largest bucket"):
        graphs.run(DecodeStep([1, 2, 3], [0, 0, 0], [1, 1, 1], [[0], [1], [2]]))
    with pytest.raises(ValueError, match="larger than the buffers"):
        DecodeGraphs(tiny.model, kv, buffers, [1, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_give_eager_greedy_tokens_at_every_bucket(
    tiny_llama_dir: Path, dtype: torch.dtype
) -> None:
    from engine.model_loader import load_model
    from portico.registry import resolve

    loaded = load_model(resolve(str(tiny_llama_dir)), dtype, "cuda")
    vocab = loaded.config.vocab_size
    results = []
    for eager_flag in (True, False):
        config = EngineConfig(
            model=str(tiny_llama_dir), block_size=BLOCK_SIZE, max_num_seqs=5,
            enforce_eager=eager_flag,
        )  # fmt: skip
        runner = ModelRunner(loaded, config, num_gpu_blocks=NUM_BLOCKS)
        assert (runner.graphs is None) == eager_flag
        if runner.graphs is not None:
            assert runner.graphs.captured == [1, 2, 4, 5]
        # decodes of 5, 3 (bucket 4), 1, 2 and 4 requests: every bucket, with and without pad
        steps = [*STEPS, [("a", 1), ("b", 1)], [("a", 1), ("b", 1), ("c", 1), ("d", 1)]]
        results.append(_run(runner, steps, vocab)[1])
    assert results[0] == results[1]


def _with_graph_buffers(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Give ``engine``'s runner decode graphs over buffers (no capture, CPU), a cache with one
    scratch block past the pool, and the CUDA decision; returns the list of buckets run."""
    runner = engine.runner
    num_blocks = runner.kv_caches[0].shape[1]
    shape = (2, num_blocks + 1, *runner.kv_caches[0].shape[2:])
    runner.kv_caches[:] = [torch.zeros(shape, dtype=c.dtype) for c in runner.kv_caches]
    max_seqs = engine.config.max_num_seqs
    width = -(-runner.config.max_position_embeddings // runner.block_size)
    buffers = DecodeBuffers(max_seqs, width, runner.block_size, num_blocks, runner.device)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, buffers, plan_buckets(max_seqs))
    real_reason = model_runner_module.fallback_reason
    monkeypatch.setattr(
        model_runner_module, "fallback_reason",
        lambda **kw: real_reason(**(kw | {"device_type": "cuda"})),
    )  # fmt: skip
    buckets: list[int] = []
    load = buffers.load
    monkeypatch.setattr(
        buffers, "load", lambda s, b, *ids: (buckets.append(b), load(s, b, *ids))[1]
    )  # ids: the previous step's sampled ids, with --async-scheduling
    return buckets


def test_engine_on_graph_buffers_equals_eager_with_preemption_and_a_cached_prefix(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiny_engine import make_engine, run_all

    gen = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, 1000, (24,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, 1000, (3 + i,), generator=gen).tolist() for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(
            temperature=0.9,
            top_p=0.8,
            seed=7,
            max_tokens=24,
            ignore_eos=True,
            repetition_penalty=1.2,
        ),  # fmt: skip
    ]
    outputs = []
    for graphs in (False, True):
        engine = make_engine(tiny, num_gpu_blocks_override=18, max_num_seqs=8, block_size=4)
        buckets = _with_graph_buffers(engine, monkeypatch) if graphs else []
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params[i % 2])
        finals = run_all(engine)
        outputs.append({rid: out.outputs[0].token_ids for rid, out in finals.items()})
        stats = engine.stats()
        assert stats.num_preemptions > 0  # 18 blocks of 4 cannot hold all six
        assert stats.prefix_cache_hits > 0  # the shared 24-token prefix
        if graphs:
            assert len(buckets) > 10 and set(buckets) <= {1, 2, 4, 8}
    assert outputs[0] == outputs[1]


def test_only_a_cache_the_split_k_kernel_reads_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs capture decode attention only where the split-K kernel serves the cache (it reads
    lengths from device tensors); the CPU kernels, and the paths that read host-side lengths,
    are never captured."""
    from engine import kernels

    bf16_cache = torch.zeros(2, 2, 16, 1, 32, dtype=torch.bfloat16)
    kernels.choose.cache_clear()
    try:
        assert not kernels.decode_attention_capturable(bf16_cache)  # CPU kernels
        monkeypatch.setenv(kernels.KERNEL_DEVICE_ENV, "cuda")
        kernels.choose.cache_clear()
        assert kernels.decode_attention_capturable(bf16_cache)  # the split-K kernel's choice
        monkeypatch.setattr(
            "engine.kernels.triton_decode_attention.serves", lambda kv_cache: False
        )  # an fp8 cache before sm 8.9: the reference reads host-side lengths
        assert not kernels.decode_attention_capturable(bf16_cache)
    finally:
        monkeypatch.delenv(kernels.KERNEL_DEVICE_ENV, raising=False)
        kernels.choose.cache_clear()
