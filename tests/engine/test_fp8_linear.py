"""``--quantization fp8`` (engine/models/fp8_linear.py): e4m3 projections with per-channel
scales, per-token activation scales, torch's scaled matmul; run here on the CPU's kernel."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.memory_plan import plan
from engine.model_loader import LoadedModel, load_model, resolve_quantization
from engine.models import fp8_linear
from engine.models.fp8_linear import FP8_MAX, fp8_unsupported_reason, quantize_rows, quantize_weight
from engine.models.fp8_linear import fp8_linear as fp8_matmul
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource, resolve

pytestmark = pytest.mark.skipif(
    fp8_unsupported_reason("cpu") is not None, reason=str(fp8_unsupported_reason("cpu"))
)

# e4m3: 3 mantissa bits, so a normal value rounds within 2**-4 of itself; below the smallest
# normal (2**-6, in scaled units) the spacing is 2**-9, so within 2**-10 scaled units.
REL = 2.0**-4
SUBNORMAL_ABS = 2.0**-10
# Documented tolerance for greedy decoding (docs/gpu-fast-path.md): fp8 keeps the float
# model's greedy token wherever the float model's best logit leads its second by more than
# this many nats; where it leads by less, the two may pick differently.
GREEDY_MARGIN = 0.5


def rounding_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most :func:`quantize_rows` may move each element of ``values`` (rows scaled by
    ``scale`` [rows, 1])."""
    return values.abs() * REL + scale * SUBNORMAL_ABS


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "dtype"),
    [(1, 64, 32, torch.float32), (7, 576, 960, torch.float32), (5, 128, 48, torch.bfloat16)],
)
def test_a_layer_stays_within_the_e4m3_rounding_bound(
    rows: int, in_features: int, out_features: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, in_features, generator=gen) * 3).to(dtype)
    x[0, :8] = 1e-4  # tiny inputs beside big ones: the subnormal range of the token's scale
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    bias = torch.randn(out_features, generator=gen).to(dtype)
    q = quantize_weight(w)
    got = fp8_matmul(x, q, bias).float()
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = x.float() @ w.T + bias.float()
    # |x'w' - xw| <= |x' - x| |w'| + |x| |w' - w|, element by element, summed over inputs
    _, x_scale = quantize_rows(x)
    dx = rounding_bound(x.float(), x_scale)
    dw = rounding_bound(w, q.scale.t())
    bound = dx @ (w.abs() + dw).T + x.float().abs() @ dw.T
    if dtype == torch.bfloat16:  # the output is rounded to bf16 too
        bound = bound + exact.abs() * 2.0**-8 + 1e-6
    err = (got - exact).abs()
    assert bool((err <= bound * 1.001 + 1e-5).all()), float((err - bound).max())
    # and the bound is not vacuous: the error is a few percent of the output's size
    assert float(err.norm() / exact.norm()) < 0.08


def test_quantization_is_exact_on_e4m3_values_and_safe_on_zero_rows() -> None:
    values = torch.tensor([[448.0, -1.0, 0.5, 2.0**-9 * 448 / 448], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(values)
    assert scale[0, 0] == 1.0  # max |x| is e4m3's max: no rescaling
    assert torch.equal(q.float() * scale, values)
    assert torch.equal(q[1].float(), torch.zeros(4)) and float(scale[1, 0]) > 0
    w = quantize_weight(torch.tensor([[896.0, -448.0], [3.0, 1.5]]))
    assert torch.equal(w.dequantize(), torch.tensor([[896.0, -448.0], [3.0, 1.5]]))
    assert w.nbytes == 4 * 1 + 2 * 4  # 1 byte a weight, a float32 scale a row
    assert fp8_matmul(torch.empty(0, 2), w, None).shape == (0, 2)


def test_rows_are_independent_of_the_batch() -> None:
    """Per-token activation scales: a row's output does not depend on its neighbours."""
    gen = torch.Generator().manual_seed(3)
    w = quantize_weight(torch.randn(32, 64, generator=gen))
    x = torch.randn(6, 64, generator=gen)
    x[3] *= 100  # a loud neighbour would change a per-tensor scale
    q, scale = quantize_rows(x)
    for i in range(6):
        q_i, scale_i = quantize_rows(x[i : i + 1])
        assert torch.equal(q_i.float(), q[i : i + 1].float()) and torch.equal(
            scale_i, scale[i : i + 1]
        )
    alone = torch.cat([fp8_matmul(x[i : i + 1], w, None) for i in range(6)])
    # the same quantized operands; only the float32 summation order may differ with the batch
    torch.testing.assert_close(fp8_matmul(x, w, None), alone, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: Path) -> tuple[LoadedModel, LoadedModel]:
    source = ModelSource("tiny", tiny_llama_dir, "hf")
    return (
        load_model(source, torch.float32, "cpu"),
        load_model(source, torch.float32, "cpu", quantization="fp8"),
    )


def test_the_loader_quantizes_the_projections_only(
    tiny_pair: tuple[LoadedModel, LoadedModel],
) -> None:
    dense, fp8 = tiny_pair
    layer, ref = fp8.model.model.layers[1], dense.model.model.layers[1]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module, reference = layer.get_submodule(name), ref.get_submodule(name)
        assert module.fp8 is not None and module.fp8.qweight.dtype == torch.float8_e4m3fn
        assert module.weight.numel() == 0  # the dense copy is dropped
        w = reference.weight.detach()
        moved = (module.fp8.dequantize() - w).abs()
        assert bool((moved <= rounding_bound(w, module.fp8.scale.t())).all())
    assert torch.equal(fp8.model.model.embed_tokens.weight, dense.model.model.embed_tokens.weight)
    assert fp8.model.model.embed_tokens.weight.dtype == torch.float32  # embeddings/head stay


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[object]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def assert_greedy_within_margin(reference: list[object], other: list[object]) -> int:
    """Each pair of greedy runs agrees up to its first difference, and that difference comes
    where the reference's best token leads its second by less than GREEDY_MARGIN. Returns the
    number of tokens compared that agree."""
    agreed = 0
    for ref, got in zip(reference, other, strict=True):
        for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):  # type: ignore[attr-defined]
            if a != b:
                top = ref.logprobs[i].top_logprobs  # type: ignore[attr-defined]
                lead = top[0][1] - top[1][1]
                assert lead < GREEDY_MARGIN, (i, a, b, lead)
                break
            agreed += 1
    return agreed


def test_greedy_tokens_of_the_tiny_model_follow_its_float_run(
    tiny_pair: tuple[LoadedModel, LoadedModel],
) -> None:
    dense, fp8 = tiny_pair
    prompts = [[11 + i, 500 + 7 * i, 42, 900 - i, 3 * i + 1] for i in range(6)]
    runs = []
    for loaded in (dense, fp8):
        config = EngineConfig(model="tiny", device="cpu", dtype="float32",
                              num_gpu_blocks_override=64)  # fmt: skip
        runs.append(_greedy(LLM.from_engine(LLMEngine(config, loaded)), prompts, 12))
    agreed = assert_greedy_within_margin(runs[0], runs[1])
    assert agreed >= len(prompts)  # at least each run's first token where it leads clearly


def test_dummy_weights_load_in_fp8_and_serve(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "shape"
    shutil.copytree(tiny_llama_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", load_format="dummy",
                          quantization="fp8", num_gpu_blocks_override=32)  # fmt: skip
    llm = LLM.from_engine(LLMEngine.from_config(config))
    out = _greedy(llm, [[5, 6, 7]], 4)
    assert len(out[0].token_ids) == 4  # type: ignore[attr-defined]
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.fp8 is not None


def test_the_memory_plan_counts_fp8_weight_bytes(
    tiny_llama_dir: Path, tiny_pair: tuple[LoadedModel, LoadedModel]
) -> None:
    dense_model, fp8_model = tiny_pair
    common = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32",
                  num_gpu_blocks_override=8)  # fmt: skip
    dense = plan(EngineConfig(**common, quantization="none"), memory_bytes=2**30)
    fp8 = plan(EngineConfig(**common, quantization="fp8"), memory_bytes=2**30)
    assert fp8.quantization == "fp8"

    def resident(loaded: LoadedModel) -> int:
        params = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        scaled = sum(m.fp8.nbytes for m in loaded.model.modules() if getattr(m, "fp8", None))
        return params + scaled

    assert dense.weights.dense == resident(dense_model)
    assert fp8.weights.dense == resident(fp8_model)
    assert fp8.weights.dense < dense.weights.dense


def test_the_flag_is_refused_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    source = resolve(str(tiny_llama_dir))
    with pytest.raises(ValueError, match="--quantization fp8 is not supported with --tensor"):
        EngineConfig(model="tiny", quantization="fp8", tensor_parallel_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--quantization fp8 cannot run on cuda: CUDA is not"):
            resolve_quantization("fp8", source, "cuda")
    # an older card: capability below 8.9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    reason = fp8_unsupported_reason("cuda")
    assert reason is not None and "8.9" in reason and "A100 is 8.0" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_unsupported_reason("cuda") is None
    # CUDA's scaled matmul takes multiples of 16 only
    with pytest.raises(
        ValueError, match=r"--quantization fp8: layers.0.mlp.down_proj is \[72, 40\]"
    ):
        fp8_linear.check_fp8_shape("layers.0.mlp.down_proj", 72, 40, torch.device("cuda"))
    fp8_linear.check_fp8_shape("layers.0.mlp.down_proj", 72, 40, torch.device("cpu"))

    # a CPU build without the fp8 kernel
    def missing(*args: object, **kwargs: object) -> None:
        raise RuntimeError('"_scaled_mm_cpu" not implemented for Float8_e4m3fn')

    monkeypatch.setattr(torch, "_scaled_mm", missing)
    reason = fp8_unsupported_reason("cpu")
    assert reason is not None and "not implemented" in reason
    with pytest.raises(ValueError, match="--quantization fp8 cannot run on cpu: .*_scaled_mm"):
        resolve_quantization("fp8", source, "cpu")


def test_the_cli_takes_the_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert FP8_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])


@pytest.fixture(scope="module")
def real_models(smollm2_gguf: Path) -> Iterator[tuple[LoadedModel, LoadedModel]]:
    source = ModelSource("smollm2", smollm2_gguf, "gguf")
    yield (
        load_model(source, torch.float32, "cpu"),
        load_model(source, torch.float32, "cpu", quantization="fp8"),
    )


@pytest.mark.slow
def test_the_default_models_gguf_in_fp8_follows_its_float32_run(
    real_models: tuple[LoadedModel, LoadedModel], one_torch_thread: None
) -> None:
    """GGUF weights dequantized, then rounded to e4m3: greedy replies on real text."""
    runs = []
    for loaded in real_models:
        config = EngineConfig(model="smollm2", device="cpu", dtype="float32", quantization="none",
                              num_gpu_blocks_override=64)  # fmt: skip
        llm = LLM.from_engine(LLMEngine(config, loaded))
        ids = llm.tokenizer.encode("The capital of France is")
        runs.append(_greedy(llm, [ids, llm.tokenizer.encode("def reverse(s):")], 8))
    assert assert_greedy_within_margin(runs[0], runs[1]) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(
    torch.cuda.is_available() and fp8_unsupported_reason("cuda") is not None,
    reason="needs compute capability 8.9+",
)
def test_fp8_on_cuda_follows_bf16_with_and_without_graphs(tiny_llama_dir: Path) -> None:
    """On the card: fp8 (CUDA's row-wise scaled matmul, bf16 activations) keeps bf16's greedy
    tokens within the margin, and the captured decode graphs keep fp8's eager tokens within
    it (the padded bucket may pick another matmul kernel than the eager step)."""
    prompts = [[11 + i, 500 + 7 * i, 42, 900 - i, 3 * i + 1] for i in range(5)]
    runs = {}
    for name, quantization, eager in (("bf16", "none", True), ("fp8 eager", "fp8", True),
                                      ("fp8 graphs", "fp8", False)):  # fmt: skip
        config = EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16",
                              quantization=quantization, enforce_eager=eager, max_num_seqs=5,
                              num_gpu_blocks_override=64)  # fmt: skip
        engine = LLMEngine.from_config(config)
        try:
            runs[name] = _greedy(LLM.from_engine(engine), prompts, 12)
        finally:
            engine.close()
    assert assert_greedy_within_margin(runs["bf16"], runs["fp8 eager"]) >= len(prompts)
    assert assert_greedy_within_margin(runs["fp8 eager"], runs["fp8 graphs"]) >= len(prompts)
