"""The fused float32 panel step (engine/models/panel_step.py, csrc/panel_step.c) computes
exactly what the layer-by-layer Python path computes on the batch invariant path: the same
logits bit for bit (torch.equal), the same hidden states and the same K/V in the cache, for
steps of 1 to 8 rows after a cached prefix, at 1 and 2 threads, on a tiny random model in
GGUF blocks and on the real default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_llama import build_tiny_llama

from engine.attention import AttentionMetadata
from engine.kernels import cpu
from engine.kv_cache_dtype import cache_shape
from engine.model_loader import load_model
from engine.models.block_linear import BlockLinear, GGUFBlocks
from engine.models.llama import LlamaForCausalLM
from engine.models.panel_step import MAX_ROWS, FusedPanelStep, use_native_norms
from portico.registry import ModelSource

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the native CPU kernels")

# head_dim 32, a Q4_1 and a Q8_0 projection, biases on q/k/v (Qwen2's), widths not a multiple
# of 16 output rows (the last panel padded).
SIZES = {"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 3,
         "num_key_value_heads": 1}  # fmt: skip


def _random_blocks(kind: str, rows: int, cols: int, gen: torch.Generator) -> GGUFBlocks:
    nb = cols // 32
    scales = (torch.rand(rows, nb, generator=gen) * 0.01 + 0.004).half().float()
    if kind == "q8_0":
        qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
        return GGUFBlocks(kind, qs, scales)
    qs = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    mins = (torch.randn(rows, nb, generator=gen) * 0.03).half().float()
    return GGUFBlocks(kind, qs, scales, mins)


def _in_panels(model: LlamaForCausalLM, seed: int) -> None:
    """Every projection in GGUF blocks (o_proj Q8_0, the others Q4_1; a random bias on
    qkv_proj) and the tied head in Q8_0, packed in panels: what the loader builds under
    float32, with the native norms and the fused step it attaches."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, BlockLinear):
            kind = "q8_0" if name.endswith("o_proj") else "q4_1"
            blocks = _random_blocks(kind, *module.weight.shape, gen)
            module.weight.data = blocks.dequantize()
            blocks.pack_panels()
            module.blocks = blocks
            if name.endswith("qkv_proj"):
                module.bias = torch.nn.Parameter(torch.randn(module.weight.shape[0], generator=gen))
    head = _random_blocks("q8_0", *model.model.embed_tokens.weight.shape, gen)
    head.scales = (head.scales * 20).half().float()  # float16 values, as a file's
    model.model.embed_tokens.weight.data = head.dequantize()
    head.pack_panels()
    model.lm_head_blocks = head
    use_native_norms(model)
    model.fused_step = FusedPanelStep.build(model)


@pytest.fixture(scope="module")
def tiny_panels(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    folder = build_tiny_llama(tmp_path_factory.mktemp("panel") / "tiny", seed=4, **SIZES)
    model = load_model(ModelSource("tiny", Path(folder), "hf"), torch.float32, "cpu").model
    _in_panels(model, seed=9)
    assert isinstance(model.fused_step, FusedPanelStep)
    return model


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _caches(model: LlamaForCausalLM, dtype: torch.dtype, blocks: int = 16) -> list[torch.Tensor]:
    cfg = model.config
    shape = cache_shape(dtype, blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]


def _run(model, caches, steps, fused):  # type: ignore[no-untyped-def]
    """Run ``steps`` (each a list of (tokens, first position, block table)); per step, the
    hidden states and the logits of every row. ``fused`` False: the Python path only."""
    saved, model.fused_step = model.fused_step, (model.fused_step if fused else None)
    out = []
    try:
        for step in steps:
            ids = [t for tokens, _, _ in step for t in tokens]
            pos = [s + i for tokens, s, _ in step for i in range(len(tokens))]
            q_lens = [len(tokens) for tokens, _, _ in step]
            s_lens = [s + len(t) for t, s, _ in step]
            meta = AttentionMetadata.build(q_lens, s_lens, [t for _, _, t in step], 16)
            rows = torch.arange(len(ids))
            with torch.inference_mode():
                out.append(model.forward_and_logits(
                    torch.tensor(ids), torch.tensor(pos), caches, meta, rows))  # fmt: skip
    finally:
        model.fused_step = saved
    return out


def _small_steps(vocab: int, seed: int) -> list[list[list[tuple[list[int], int, list[int]]]]]:
    """For each number of rows 1..8, a prefill of two prompts (12 and 7 tokens: the Python
    path's rows) then one step of that many rows after the cached prefixes: decodes of both,
    or a short chunk of one beside a decode of the other."""
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (20, 15))
    ta, tb = [0, 1], [2, 3]
    scenarios = []
    for rows in range(1, MAX_ROWS + 1):
        prefill = [(a[:12], 0, ta), (b[:7], 0, tb)]
        small = [(a[12 : 12 + rows], 12, ta)] if rows % 2 else [
            (a[12 : 12 + rows - 1], 12, ta), (b[7:8], 7, tb)]  # fmt: skip
        scenarios.append([prefill, small])
    return scenarios


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_panel_step_equals_the_python_path_bit_for_bit(
    tiny_panels: LlamaForCausalLM, cache_dtype: torch.dtype, threads: int, restore_threads: None
) -> None:
    torch.set_num_threads(threads)
    model = tiny_panels
    for steps in _small_steps(model.config.vocab_size, seed=threads):
        caches_f, caches_p = _caches(model, cache_dtype), _caches(model, cache_dtype)
        fused = _run(model, caches_f, steps, fused=True)
        plain = _run(model, caches_p, steps, fused=False)
        (hf, lf), (hp, lp) = fused[-1], plain[-1]
        assert torch.equal(lf, lp) and torch.equal(hf, hp)
        assert all(torch.equal(f, p) for f, p in zip(caches_f, caches_p, strict=True))


def _long_decodes(vocab: int, seed: int) -> list[list[list[tuple[list[int], int, list[int]]]]]:
    """Prefills of three prompts (150, 77 and 64 tokens: contexts over several of the fused
    attention's 64-position spans, one ending on a span's edge), then decode steps of one, two
    and three of them."""
    gen = torch.Generator().manual_seed(seed)
    lens = (150, 77, 64)
    prompts = [torch.randint(3, vocab, (n + 1,), generator=gen).tolist() for n in lens]
    tables = [list(range(0, 10)), list(range(10, 15)), list(range(15, 20))]
    prefill = [(p[:n], 0, t) for p, n, t in zip(prompts, lens, tables, strict=True)]
    decodes = [(p[n : n + 1], n, t) for p, n, t in zip(prompts, lens, tables, strict=True)]
    return [[prefill, decodes[:k]] for k in (1, 2, 3)]


@pytest.fixture(scope="module")
def tiny_panels_wide(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    """Two KV heads of 64 dims (two of the fused attention's 32-dim tiles each)."""
    sizes = {"hidden_size": 256, "intermediate_size": 192, "num_attention_heads": 4,
             "num_key_value_heads": 2}  # fmt: skip
    folder = build_tiny_llama(tmp_path_factory.mktemp("panel") / "wide", seed=5, **sizes)
    model = load_model(ModelSource("wide", Path(folder), "hf"), torch.float32, "cpu").model
    _in_panels(model, seed=11)
    assert isinstance(model.fused_step, FusedPanelStep)
    return model


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decodes_at_long_contexts_equal_the_python_path_bit_for_bit(
    tiny_panels: LlamaForCausalLM,
    tiny_panels_wide: LlamaForCausalLM,
    wide: bool,
    threads: int,
    cache_dtype: torch.dtype,
    restore_threads: None,
) -> None:
    """A step of decode rows splits its attention across the team by positions, queries and
    head dims (csrc/panel_step.c): the logits, hidden states and caches are still the Python
    path's, whose attention takes each KV head whole."""
    torch.set_num_threads(threads)
    model = tiny_panels_wide if wide else tiny_panels
    for steps in _long_decodes(model.config.vocab_size, seed=threads):
        caches_f, caches_p = _caches(model, cache_dtype, 20), _caches(model, cache_dtype, 20)
        (hf, lf), (hp, lp) = (
            _run(model, caches_f, steps, True)[-1],
            _run(model, caches_p, steps, False)[-1],
        )
        assert torch.equal(lf, lp) and torch.equal(hf, hp)
        assert all(torch.equal(f, p) for f, p in zip(caches_f, caches_p, strict=True))


def test_the_fused_call_runs_and_serves_only_small_steps(tiny_panels: LlamaForCausalLM) -> None:
    step = tiny_panels.fused_step
    assert isinstance(step, FusedPanelStep)
    assert step.serves(1) and step.serves(MAX_ROWS) and step.head_serves(MAX_ROWS)
    assert not step.serves(0) and not step.serves(MAX_ROWS + 1)
    caches = _caches(tiny_panels, torch.float32)
    meta = AttentionMetadata.build([2], [2], [[0]], 16)
    with torch.inference_mode():
        ids, pos = torch.tensor([5, 6]), torch.tensor([0, 1])
        done = step.run(ids, pos, caches, meta, torch.tensor([1]))
    vocab = tiny_panels.config.vocab_size
    assert done is not None and done[1] is not None and done[1].shape == (1, vocab)


def test_models_the_fused_panel_step_cannot_serve_get_none(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "tiny", seed=3, **SIZES)
    source = ModelSource("tiny", Path(folder), "hf")
    dense = load_model(source, torch.float32, "cpu")  # no GGUF blocks
    assert dense.model.fused_step is None and FusedPanelStep.build(dense.model) is None
    bf16 = load_model(source, torch.bfloat16, "cpu")
    assert FusedPanelStep.build(bf16.model) is None
    caches = [torch.zeros(1, dtype=torch.bfloat16)]  # a cache kind the call does not take
    _in_panels(dense.model, seed=1)
    step = dense.model.fused_step
    assert step is not None
    meta = AttentionMetadata.build([1], [1], [[0]], 16)
    assert step.run(torch.tensor([5]), torch.tensor([0]), caches, meta) is None


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_the_default_models_fused_step_equals_its_python_path(
    smollm2_gguf: Path, threads: int, restore_threads: None
) -> None:
    """The default model as --dtype auto loads it: the fused step is on, and its logits for 1..8
    rows after cached prefixes are the Python path's, bit for bit."""
    torch.set_num_threads(threads)
    source = ModelSource("smollm2", smollm2_gguf, "gguf")
    model = load_model(source, torch.float32, "cpu", "gguf").model
    assert isinstance(model.fused_step, FusedPanelStep) and model.fused_step.head is not None
    for steps in _small_steps(model.config.vocab_size, seed=threads):
        caches_f, caches_p = _caches(model, torch.float32), _caches(model, torch.float32)
        (hf, lf), (hp, lp) = (
            _run(model, caches_f, steps, True)[-1],
            _run(model, caches_p, steps, False)[-1],
        )
        assert torch.equal(lf, lp) and torch.equal(hf, hp)
