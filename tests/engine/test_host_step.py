"""The host step (engine/models/host_step.py) hands the fused panel call the same inputs as the
tensor path: the same logits bit for bit (torch.equal) and the same K/V in the cache, for steps
of 1 to 8 rows after cached prefixes and decodes at long contexts; it declines, writing nothing,
every step it cannot take; and the model runner gives the same logits with it and without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_panel_step import (
    SIZES,
    _caches,
    _in_panels,
    _long_decodes,
    _small_steps,
    restore_threads,  # noqa: F401 (a fixture)
    tiny_panels,  # noqa: F401 (a fixture)
)
from tiny_llama import build_tiny_llama

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.kernels import cpu
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.models.fused_step import MAX_ROWS
from engine.models.host_step import HostStep
from engine.models.llama import LlamaForCausalLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from portico.registry import ModelSource

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the native CPU kernels")

Step = list[tuple[list[int], int, list[int]]]  # (tokens, first position, block table) each


def _lists(step: Step) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    ids = [t for tokens, _, _ in step for t in tokens]
    q_lens = [len(tokens) for tokens, _, _ in step]
    s_lens = [s + len(t) for t, s, _ in step]
    return ids, q_lens, s_lens, [t for _, _, t in step]


def _tensor_path(model: LlamaForCausalLM, caches: list[torch.Tensor], step: Step) -> torch.Tensor:
    """The step's logits for every row through forward_and_logits (the fused call's tensors)."""
    ids, q_lens, s_lens, tables = _lists(step)
    pos = [s + i for tokens, s, _ in step for i in range(len(tokens))]
    meta = AttentionMetadata.build(q_lens, s_lens, tables, 16)
    with torch.inference_mode():
        _, logits = model.forward_and_logits(
            torch.tensor(ids), torch.tensor(pos), caches, meta, torch.arange(len(ids))
        )
    return logits


def _host_path(host: HostStep, step: Step) -> torch.Tensor | None:
    ids, q_lens, s_lens, tables = _lists(step)
    return host.run(ids, q_lens, s_lens, tables, list(range(len(ids))))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("threads", [1, 2])
def test_host_step_equals_the_tensor_path_bit_for_bit(
    tiny_panels: LlamaForCausalLM,  # noqa: F811
    cache_dtype: torch.dtype,
    threads: int,
    restore_threads: None,  # noqa: F811
) -> None:
    torch.set_num_threads(threads)
    model = tiny_panels
    vocab = model.config.vocab_size
    scenarios = _small_steps(vocab, seed=threads) + _long_decodes(vocab, seed=threads)
    for prefill, small in scenarios:
        caches_h, caches_t = _caches(model, cache_dtype, 20), _caches(model, cache_dtype, 20)
        host = HostStep.build(model, caches_h, max_blocks=20)
        assert host is not None
        for caches in (caches_h, caches_t):  # the prefixes, through the tensor path
            _tensor_path(model, caches, prefill)
        logits = _host_path(host, small)
        assert logits is not None and logits.dtype == torch.float32
        assert torch.equal(logits, _tensor_path(model, caches_t, small))
        assert all(torch.equal(h, t) for h, t in zip(caches_h, caches_t, strict=True))
        # the buffers hold the longer step's numbers: a shorter one after it is still exact
        one = [(small[0][0][:1], small[0][1], small[0][2])]
        nxt = [([t + 1 for t in one[0][0]], one[0][1] + 1, one[0][2])]
        h1, t1 = _host_path(host, one), _tensor_path(model, caches_t, one)
        assert h1 is not None and torch.equal(h1, t1)
        h2, t2 = _host_path(host, nxt), _tensor_path(model, caches_t, nxt)
        assert h2 is not None and torch.equal(h2, t2)
        assert h2 is h1  # one logits tensor per row count, rewritten by each step


def test_host_step_declines_what_it_cannot_take_and_writes_nothing(
    tiny_panels: LlamaForCausalLM,  # noqa: F811
) -> None:
    model = tiny_panels
    caches = _caches(model, torch.float32, 20)
    host = HostStep.build(model, caches, max_blocks=4)
    assert host is not None
    before = [c.clone() for c in caches]
    too_many = [(list(range(3, 3 + MAX_ROWS + 1)), 0, [0])]
    too_wide = [([5], 70, [0, 1, 2, 3, 4])]  # 5 blocks, the buffer holds 4
    short_table = [([5], 20, [0])]  # position 20 is past one block of 16
    assert _host_path(host, too_many) is None
    assert _host_path(host, too_wide) is None
    assert _host_path(host, short_table) is None
    assert host.run([5], [2], [1], [[0]], [0]) is None  # more new tokens than the context
    assert host.run([5], [1], [1], [[0]], []) is None  # no row to sample
    assert all(torch.equal(b, c) for b, c in zip(before, caches, strict=True))
    caches[0] = caches[0].clone()  # a cache that moved
    assert _host_path(host, [([5], 0, [0])]) is None
    caches[0] = before[0]
    saved, model.fused_step = model.fused_step, None
    try:
        assert _host_path(host, [([5], 0, [0])]) is None  # the fused step was taken away
    finally:
        model.fused_step = saved
    assert all(torch.equal(b, c) for b, c in zip(before, caches, strict=True))


def test_models_and_caches_the_host_step_cannot_serve_get_none(
    tiny_panels: LlamaForCausalLM,  # noqa: F811
    tmp_path: Path,
) -> None:
    folder = build_tiny_llama(tmp_path / "tiny", seed=3, **SIZES)
    dense = load_model(ModelSource("tiny", Path(folder), "hf"), torch.float32, "cpu").model
    assert HostStep.build(dense, _caches(dense, torch.float32), 4) is None  # no fused step
    bf16 = [c.to(torch.bfloat16) for c in _caches(tiny_panels, torch.float32)]
    assert HostStep.build(tiny_panels, bf16, 4) is None  # a cache the call does not take
    half = [c.half() for c in _caches(tiny_panels, torch.float32)]
    assert HostStep.build(tiny_panels, half, 4) is not None  # float16: --kv-cache-dtype float16
    strided = [c.transpose(1, 2) for c in _caches(tiny_panels, torch.float32)]
    assert HostStep.build(tiny_panels, strided, 4) is None


def test_runner_logits_are_the_same_with_and_without_the_host_step(tmp_path: Path) -> None:
    """Through ModelRunner.execute: a prefill, steps of decodes and a short chunk beside a
    decode, then decodes; every step's logits are equal whether the host step runs or not."""
    folder = build_tiny_llama(tmp_path / "tiny", seed=4, **SIZES)
    source = ModelSource("tiny", Path(folder), "hf")
    loaded = load_model(source, torch.float32, "cpu")
    _in_panels(loaded.model, seed=9)
    config = EngineConfig(model=str(folder), block_size=16)
    with_host, without = ModelRunner(loaded, config, 12), ModelRunner(loaded, config, 12)
    host = with_host.host_step
    assert host is not None
    without.host_step = None
    served: list[bool] = []
    run = host.run

    def counted(*args: object) -> torch.Tensor | None:
        logits = run(*args)  # type: ignore[arg-type]
        served.append(logits is not None)
        return logits

    host.run = counted  # type: ignore[method-assign]
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (21, 9)]
    pairs = [[Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)] for _ in "ab"]
    tables = {"r0": [3, 0, 5], "r1": [7, 2]}
    plan = [((0, 21), (1, 4)), ((0, 1), (1, 5)), ((0, 1), (1, 1)), ((1, 1),), ((0, 1), (1, 1))]
    for scheduled in plan:
        results = []
        for runner, reqs in zip((with_host, without), pairs, strict=True):
            out = SchedulerOutput(
                scheduled=[(reqs[i], n) for i, n in scheduled], block_tables=tables
            )
            sampled, logits = runner.execute(out)
            for req, n in out.scheduled:
                req.num_computed_tokens += n
            for req, row in zip(sampled, logits, strict=True):
                req.append_output_token(int(row.argmax()))
            results.append(([r.request_id for r in sampled], logits))
        (ids_h, logits_h), (ids_t, logits_t) = results
        assert ids_h == ids_t and torch.equal(logits_h, logits_t)
    assert [r.output_token_ids for r in pairs[0]] == [r.output_token_ids for r in pairs[1]]
    assert served == [False] + [True] * 4  # the 25-token prefill declined, then every step
