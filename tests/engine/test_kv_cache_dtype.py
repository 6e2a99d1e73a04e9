"""``--kv-cache-dtype``: the 8-bit caches' rounding, the references that read them, the front
door's choice, the memory they take, and the engine features that move or share cache blocks
(prefix caching, swap, chunked prefill, speculative decoding) working on an int8 cache; a
float16 cache under float32 giving each request the same tokens alone, batched, cached, chunked
and swapped.

The native and Triton kernels' int8 paths are checked beside their other dtypes
(test_cpu_kernels.py, test_kernel_builds.py, triton_interpret_check.py); LoRA and tensor
parallelism in test_lora.py and test_tensor_parallel.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_oracle import attention_oracle, paged_case

from engine import kernels
from engine.config import EngineConfig
from engine.kernels.reference import (
    dequantize_kv_int8_ref,
    paged_attention_ref,
    quantize_kv_int8_ref,
    to_cache_rows,
)
from engine.kv_cache_dtype import cache_shape, storage_dtype
from engine.llm import LLM
from engine.model_loader import LoadedModel
from engine.model_runner import kv_cache_bytes_per_block
from engine.sampling_params import SamplingParams
from tests.engine.test_llm_engine import assert_no_blocks_held, prompt
from tests.engine.test_spec_decode import NGRAM, copy_heavy, draft_spec
from tests.engine.tiny_engine import make_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_int8_rows_round_to_within_half_a_step_and_carry_their_scale() -> None:
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 40.0])[None, :, None]
    x[4, 2] = 0  # a row of zeros: scale 0, values 0, nothing divided by it
    rows = quantize_kv_int8_ref(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127, atol=0, rtol=0)
    back = dequantize_kv_int8_ref(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 + 1e-12).all()
    assert rows[..., :64].abs().max() == 127  # the largest value of every row uses the range
    assert torch.equal(back[4, 2], torch.zeros(64))


def test_fp8_rows_saturate_instead_of_overflowing() -> None:
    x = torch.tensor([[1000.0, -1000.0, 0.3, -2.5]])
    back = to_cache_rows(x, FP8).float()
    assert back.tolist()[0][:2] == [448.0, -448.0]
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("cache_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "shape"),
    [
        (4, 2, 8, 4, [(1, 6), (1, 13), (1, 1), (1, 4)]),  # decodes: the batched path
        (6, 2, 16, 8, [(1, 9), (5, 5), (3, 17), (1, 2)]),  # decodes first, then chunks
        (3, 1, 8, 2, [(7, 11)]),
    ],
)
def test_reference_reads_an_8bit_cache_as_the_oracle_does(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shape: list[tuple[int, int]],
    dtype: torch.dtype, cache_dtype: torch.dtype,
) -> None:  # fmt: skip
    q, cache, meta, ks, vs, q_lens = paged_case(
        heads, kv_heads, head_dim, block_size, shape, dtype, block_size, cache_dtype
    )
    scale = head_dim**-0.5
    args = (q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    out = paged_attention_ref(*args, meta.query_lens_cpu, meta.seq_lens_cpu)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    # the front door serves both caches on CPU: natively for int8, by the reference for fp8
    door = kernels.paged_attention(*args, meta.query_lens_cpu, meta.seq_lens_cpu)
    torch.testing.assert_close(door.double(), expected, atol=tol, rtol=tol)


def test_flag_names_the_choices_and_resolves_auto() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, bfloat16, float16"):
        EngineConfig(kv_cache_dtype="fp8")
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype("int8", torch.float32) == torch.int8
    assert storage_dtype("fp8_e4m3", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="head_dim a multiple of 4"):
        cache_shape(torch.int8, 4, 16, 2, 62)


def test_an_int8_block_takes_half_a_bf16_block_plus_its_scales(tiny: LoadedModel) -> None:
    cfg = tiny.config
    bf16 = kv_cache_bytes_per_block(cfg, 16, torch.bfloat16)
    int8 = kv_cache_bytes_per_block(cfg, 16, torch.int8)
    rows = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads
    assert int8 == bf16 // 2 + rows * 4
    assert kv_cache_bytes_per_block(cfg, 16, FP8) == bf16 // 2
    budget = 256 * bf16
    engine = make_engine(tiny, num_gpu_blocks_override=None, kv_cache_memory=budget,
                         kv_cache_dtype="int8")  # fmt: skip
    assert engine.runner.num_gpu_blocks == budget // int8
    assert engine.runner.num_gpu_blocks >= 1.5 * 256  # head_dim 16 pays 25% for its scales


def test_int8_cache_holds_rows_with_scales_and_generates(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, kv_cache_dtype="int8")
    cache = engine.runner.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == tiny.config.head_dim + 4
    engine.add_request("a", prompt(40), GREEDY)
    out = run_all(engine)["a"]
    assert len(out.outputs[0].token_ids) == 24
    written = cache[0].flatten(0, 1)[:40]  # the prompt's K rows: values and non-zero scales
    assert (written[..., -4:].contiguous().view(torch.float32) > 0).all()
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_prefix_hit_on_an_8bit_cache_gives_the_uncached_output(
    tiny: LoadedModel, kv_cache_dtype: str
) -> None:
    shared = prompt(160, start=3)
    first, second = shared + prompt(9, start=1000), shared + prompt(23, start=2000)
    engine = make_engine(tiny, kv_cache_dtype=kv_cache_dtype)
    llm = LLM.from_engine(engine)
    llm.generate([first], GREEDY)
    hit = llm.generate([second], GREEDY)[0]
    assert hit.num_cached_tokens == 160  # read back from the 8-bit blocks the first wrote
    cold = make_engine(tiny, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    fresh = LLM.from_engine(cold).generate([second], GREEDY)[0]
    assert fresh.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_no_blocks_held(engine)


@pytest.mark.parametrize(("kv_cache_dtype", "storage"), [("int8", torch.int8), ("fp8_e4m3", FP8)])
def test_swap_recompute_and_chunked_prefill_keep_the_8bit_output(
    tiny: LoadedModel, kv_cache_dtype: str, storage: torch.dtype
) -> None:
    prompts = [prompt(30 + i, start=i * 50) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_engine(tiny, kv_cache_dtype=kv_cache_dtype)
    expected = [o.outputs[0].token_ids for o in LLM.from_engine(roomy).generate(prompts, params)]
    for mode in ("recompute", "swap"):
        engine = make_engine(
            tiny, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=20, preemption_mode=mode,
            max_num_batched_tokens=24,  # every prompt prefills in chunks
        )  # fmt: skip
        if mode == "swap":  # the swap pool keeps int8 rows' scales: same layout, same dtype
            assert engine.runner.cpu_kv_caches[0].dtype == storage
            assert engine.runner.cpu_kv_caches[0].shape[2:] == engine.runner.kv_caches[0].shape[2:]
        tight = LLM.from_engine(engine).generate(prompts, params)
        assert engine.stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in tight] == expected
        assert_no_blocks_held(engine)


def test_a_float16_cache_gives_each_request_the_same_tokens_whatever_shares_its_steps(
    tiny: LoadedModel,
) -> None:
    """Under float32 every K/V value is rounded to float16 once, when written, and every step
    reads the rounded value (the step's own tokens included): a request's tokens do not depend
    on the batch, on a prefix hit, on chunked prefill, or on preemption by swap or recompute."""
    assert storage_dtype("float16", torch.float32) == torch.float16
    shared = prompt(160, start=3)
    prompts = [shared + prompt(9 + 7 * i, start=1000 * (i + 1)) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    alone = []
    for p in prompts:  # one at a time, each on a fresh engine: no cache hit, no neighbour
        cold = make_engine(tiny, kv_cache_dtype="float16", enable_prefix_caching=False)
        assert cold.runner.kv_caches[0].dtype == torch.float16
        alone.append(LLM.from_engine(cold).generate([p], params)[0].outputs[0].token_ids)
    engine = make_engine(tiny, kv_cache_dtype="float16")
    llm = LLM.from_engine(engine)
    batched = llm.generate(prompts, params)  # together, the shared prefix computed once
    assert [o.outputs[0].token_ids for o in batched] == alone
    hits = llm.generate(prompts[::-1], params)  # every prefix now a cache hit
    assert all(o.num_cached_tokens >= 160 for o in hits)
    assert [o.outputs[0].token_ids for o in hits] == alone[::-1]
    assert_no_blocks_held(engine)
    for mode in ("recompute", "swap"):
        tight = make_engine(
            tiny, kv_cache_dtype="float16", num_gpu_blocks_override=20, preemption_mode=mode,
            max_num_batched_tokens=24,  # every prompt prefills in chunks
            enable_prefix_caching=False,  # no shared blocks: the pool runs out, requests yield
        )  # fmt: skip
        out = LLM.from_engine(tight).generate(prompts, params)
        assert tight.stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in out] == alone
        assert_no_blocks_held(tight)
    # a float16 cache holds half a float32 block's bytes, so twice the blocks in one budget
    cfg = tiny.config
    assert kv_cache_bytes_per_block(cfg, 16, torch.float16) * 2 == kv_cache_bytes_per_block(
        cfg, 16, torch.float32
    )


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_decoding_on_an_int8_cache_keeps_the_output(
    tiny: LoadedModel, tiny_llama_dir: Path, proposer: str
) -> None:
    prompts = [copy_heavy(i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM.from_engine(make_engine(tiny, kv_cache_dtype="int8")).generate(prompts, params)
    spec = NGRAM if proposer == "ngram" else draft_spec(tiny_llama_dir)
    engine = make_engine(tiny, kv_cache_dtype="int8", speculative_config=spec)
    guessed = LLM.from_engine(engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in guessed] == [o.outputs[0].token_ids for o in plain]
    stats = engine.speculation.stats  # type: ignore[union-attr]
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_no_blocks_held(engine)
