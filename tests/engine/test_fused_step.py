"""The fused native step (engine/models/fused_step.py, csrc/decode_step.c) computes exactly
what the layer-by-layer Python path computes with the same int8 block linears: the same
hidden states bit for bit and the same K/V in the cache, for decodes, short prefill chunks and
several requests in one step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_llama import build_tiny_llama

from engine.attention import AttentionMetadata
from engine.kernels import cpu
from engine.kv_cache_dtype import cache_shape
from engine.model_loader import load_model
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.fused_step import MAX_ROWS, FusedDecodeStep
from engine.models.llama import LlamaForCausalLM
from portico.registry import ModelSource

pytestmark = pytest.mark.skipif(
    not cpu.int8_available(),
    reason="the fused step needs the native library built with AVX512-VNNI or AVX2",
)

# head_dim 32 and widths that are multiples of 64: sizes the fused step serves.
FUSED_SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4}


def _attach_random_blocks(model: LlamaForCausalLM, seed: int) -> None:
    """Give every projection GGUF blocks (Q4_1, and Q8_0 for o_proj; float16 scales, as in a
    GGUF file) and make its dense weight the one they encode, as the GGUF loader does."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if not isinstance(module, BlockLinear):
            continue
        rows, cols = module.weight.shape
        nb = cols // 32
        scales = (torch.rand(rows, nb, generator=gen) * 0.01 + 0.002).half().float()
        if name.endswith("o_proj"):
            qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
            blocks = GGUFBlocks("q8_0", qs, scales)
        else:
            qs = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
            mins = (torch.randn(rows, nb, generator=gen) * 0.02).half().float()
            blocks = GGUFBlocks("q4_1", qs, scales, mins)
        module.weight.data = blocks.dequantize().to(module.weight.dtype)
        module.packed = None
        assert blocks.pack_q8()
        module.blocks = blocks


@pytest.fixture(scope="module")
def fused_model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    folder = build_tiny_llama(tmp_path_factory.mktemp("fused") / "tiny", seed=3, **FUSED_SIZES)
    loaded = load_model(ModelSource("tiny", Path(folder), "hf"), torch.bfloat16, "cpu")
    _attach_random_blocks(loaded.model, seed=5)
    loaded.model.fused_step = FusedDecodeStep.build(loaded.model)
    assert loaded.model.fused_step is not None
    return loaded.model


def _caches(
    model: LlamaForCausalLM, num_blocks: int = 12, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    cfg = model.config
    shape = cache_shape(dtype, num_blocks, 4, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]


def _step(model, ids, query_lens, seq_lens, tables, caches, fused):  # type: ignore[no-untyped-def]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 4)
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    saved, model.fused_step = model.fused_step, (model.fused_step if fused else None)
    try:
        with torch.inference_mode():
            return model(torch.tensor(ids), pos, caches, meta)
    finally:
        model.fused_step = saved


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_fused_step_equals_the_python_layers_bit_for_bit(fused_model, cache_dtype) -> None:
    model = fused_model
    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 4000, (9,), generator=gen).tolist() for _ in range(2)]
    caches_a, caches_b = _caches(model, dtype=cache_dtype), _caches(model, dtype=cache_dtype)
    for caches in (caches_a, caches_b):  # 18 tokens: the Python path for both
        _step(model, prompts[0] + prompts[1], [9, 9], [9, 9], tables, caches, fused=True)
    # A decode beside a 3-token chunk, then two decodes, then one request alone.
    for ids, q_lens, s_lens, tabs in (
        ([11, 12, 13, 14], [1, 3], [10, 12], tables),
        ([21, 22], [1, 1], [11, 13], tables),
        ([31], [1], [12], tables[:1]),
    ):
        fused = _step(model, ids, q_lens, s_lens, tabs, caches_a, fused=True)
        plain = _step(model, ids, q_lens, s_lens, tabs, caches_b, fused=False)
        assert torch.equal(fused, plain)
        assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b, strict=True))


def test_fused_head_gives_the_logits_compute_logits_gives(fused_model) -> None:
    """With the LM head in int8 blocks, the fused call also computes the sampled rows' logits;
    they, the hidden states and the caches equal the layer-by-layer path's and its head's."""
    model = fused_model
    cfg = model.config
    gen = torch.Generator().manual_seed(9)
    vocab, width = cfg.vocab_size, cfg.hidden_size
    qs = torch.randint(-128, 128, (vocab, width), dtype=torch.int8, generator=gen)
    scales = (torch.rand(vocab, width // 32, generator=gen) * 0.01).half().float()
    head = GGUFBlocks("q8_0", qs, scales)
    assert head.pack_q8()
    saved = model.fused_step, model.lm_head_blocks
    model.lm_head_blocks = head
    model.fused_step = FusedDecodeStep.build(model)
    try:
        step = model.fused_step
        assert step is not None and step.head_serves(1)
        # Q8_0 blocks serve up to 4 rows where bf16 matmuls are native, any number elsewhere
        assert step.head_serves(5) is not cpu.bf16_matmul_native()
        tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
        prompts = [torch.randint(100, 4000, (6,), generator=gen).tolist() for _ in range(2)]
        caches_a, caches_b = _caches(model), _caches(model)
        for caches in (caches_a, caches_b):
            _step(model, prompts[0] + prompts[1], [6, 6], [6, 6], tables, caches, fused=False)
        meta = AttentionMetadata.build([1, 2], [7, 8], tables, 4)
        ids, pos = torch.tensor([41, 42, 43]), torch.tensor([6, 6, 7])
        for rows in (torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([0, 1, 2, 2, 1])):
            caches_b_now = [c.clone() for c in caches_b]
            with torch.inference_mode():
                hidden, logits = model.forward_and_logits(ids, pos, caches_a, meta, rows)
                saved_step, model.fused_step = model.fused_step, None
                plain = model(ids, pos, caches_b_now, meta)
                model.fused_step = saved_step
                expected = model.compute_logits(plain.index_select(0, rows))
            assert torch.equal(hidden, plain)
            assert logits.dtype == torch.float32 and torch.equal(logits, expected)
            assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b_now, strict=True))
    finally:
        model.fused_step, model.lm_head_blocks = saved


def test_fused_step_serves_only_small_steps(fused_model) -> None:
    step = fused_model.fused_step
    assert step.serves(1) and step.serves(MAX_ROWS)
    assert not step.serves(0) and not step.serves(MAX_ROWS + 1)


def test_models_the_fused_step_cannot_serve_get_none(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "tiny", seed=3, **FUSED_SIZES)
    source = ModelSource("tiny", Path(folder), "hf")
    plain = load_model(source, torch.bfloat16, "cpu")  # no GGUF blocks
    assert FusedDecodeStep.build(plain.model) is None
    as_float = load_model(source, torch.float32, "cpu")
    _attach_random_blocks(as_float.model, seed=5)
    assert FusedDecodeStep.build(as_float.model) is None  # float32 stays exact
