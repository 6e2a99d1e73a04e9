"""Multi-LoRA in the engine: PEFT adapters give transformers+peft's merged output, token for
token, while requests of several adapters and of the base model share every step.

Adapters are made at test time on the tiny random Llama (random A and B, different ranks,
target modules, alpha and rsLoRA); the references merge each adapter into the weights with
peft and decode greedily in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter, merged_greedy
from tiny_llama import build_tiny_llama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora import LoRAError, LoRARequest
from engine.model_loader import load_model
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, targets, alpha, rslora)
    "all-r8": (8, ATTN + MLP, 16.0, False),
    "attn-r4": (4, ATTN, 8.0, False),
    "mlp-r16": (16, MLP, 32.0, True),
    "qv-r2": (2, ["q_proj", "v_proj"], 4.0, False),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("lora") / "tiny", seed=7)


@pytest.fixture(scope="module")
def hf_base(tiny: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)


@pytest.fixture(scope="module")
def adapters(tiny: Path, hf_base) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    out = {}
    for seed, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items()):
        out[name] = make_adapter(
            hf_base, tiny.parent / name, rank=rank, targets=targets, seed=seed,
            alpha=alpha, use_rslora=rslora,
        )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def prompts(tiny: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def references(hf_base, adapters, prompts) -> dict[str | None, list[list[int]]]:  # type: ignore[no-untyped-def]
    names: list[str | None] = [None, *adapters]
    return {
        n: [merged_greedy(hf_base, adapters.get(n) if n else None, p, MAX_TOKENS) for p in prompts]
        for n in names
    }


def make_engine(tiny: Path, adapters: dict[str, Path], **overrides: object) -> LLMEngine:
    settings: dict[str, object] = dict(
        model=str(tiny), device="cpu", dtype="float32", enable_lora=True, max_loras=4,
        max_lora_rank=16, kv_cache_memory="64MiB",
        lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()),
    )  # fmt: skip
    settings.update(overrides)
    config = EngineConfig(**settings)  # type: ignore[arg-type]
    return LLMEngine(config, load_model(ModelSource("tiny", tiny, "hf"), torch.float32, "cpu"))


Job = tuple[str, list[int], str | None]


def run_all(engine: LLMEngine, jobs: list[Job]) -> dict[str, list[int]]:
    """Add every (request id, prompt, adapter name) at once and step until all finish."""
    for rid, prompt, name in jobs:
        lora = engine.lora.get(name) if (name and engine.lora) else None
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_each_adapter_alone_equals_peft_merged_weights(tiny, adapters, prompts, references) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, adapters)
    for name in [None, *adapters]:
        jobs = [(f"{name}-{i}", p, name) for i, p in enumerate(prompts)]
        got = run_all(engine, jobs)
        assert [got[f"{name}-{i}"] for i in range(len(prompts))] == references[name], name
    # The adapters really change the output (B is non-zero).
    assert all(references[n] != references[None] for n in adapters)


def test_one_batch_of_four_adapters_and_base_gives_each_its_own_output(
    tiny, adapters, prompts, references
) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, adapters)
    names: list[str | None] = [None, *adapters]
    jobs = [(f"{n}-{i}", p, n) for n in names for i, p in enumerate(prompts)]
    steps_before = engine.stats().num_steps
    got = run_all(engine, jobs)
    for n in names:
        assert [got[f"{n}-{i}"] for i in range(len(prompts))] == references[n], n
    # 20 requests, 8 tokens each: they really shared steps (one prefill + 7 decodes at best).
    assert engine.stats().num_steps - steps_before < 4 * MAX_TOKENS


def test_adapters_on_an_int8_kv_cache_keep_their_own_outputs(tiny, adapters, prompts) -> None:  # type: ignore[no-untyped-def]
    """The 8-bit cache is not bit-identical to float32 K/V, so the PEFT references do not hold;
    what must: each adapter's output in a mixed batch equals its output alone, and differs
    from the base model's (the adapter's deltas reach the cached K/V)."""
    engine = make_engine(tiny, adapters, kv_cache_dtype="int8")
    assert engine.runner.kv_caches[0].dtype == torch.int8
    names: list[str | None] = [None, *adapters]
    alone = {}
    for n in names:
        got = run_all(engine, [(f"alone-{n}-{i}", p, n) for i, p in enumerate(prompts)])
        alone[n] = [got[f"alone-{n}-{i}"] for i in range(len(prompts))]
    mixed = run_all(engine, [(f"{n}-{i}", p, n) for n in names for i, p in enumerate(prompts)])
    for n in names:
        assert [mixed[f"{n}-{i}"] for i in range(len(prompts))] == alone[n], n
    assert all(alone[n] != alone[None] for n in adapters)


def test_more_adapters_than_max_loras_wait_their_turn(tiny, adapters, prompts, references) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, adapters, max_loras=2, max_cpu_loras=4)
    jobs = [(f"{n}-{i}", p, n) for n in adapters for i, p in enumerate(prompts)]
    got = run_all(engine, jobs)
    for n in adapters:
        assert [got[f"{n}-{i}"] for i in range(len(prompts))] == references[n], n


def test_lru_beyond_max_cpu_loras_evicts_and_reloads_from_disk(
    tiny, adapters, prompts, references
) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, adapters, max_loras=1, max_cpu_loras=2)
    lora = engine.lora
    assert lora is not None
    order = ["all-r8", "attn-r4", "mlp-r16", "all-r8", "qv-r2", "attn-r4"]
    for k, name in enumerate(order):
        got = run_all(engine, [(f"{k}", prompts[0], name)])
        assert got[f"{k}"] == references[name][0], (k, name)
        assert len(lora.cpu_cached_ids) <= 2
    # all-r8 was evicted by mlp-r16 before it came back; attn-r4 likewise: 6 loads from disk.
    assert lora.num_disk_loads == 6
    ids = {n: lora.get(n).lora_int_id for n in adapters}  # type: ignore[union-attr]
    assert lora.cpu_cached_ids == [ids["qv-r2"], ids["attn-r4"]]


def test_prefix_cache_is_never_shared_across_adapters(tiny, adapters, prompts, references) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, adapters, block_size=4)
    long_prompt = prompts[0] * 4  # several full blocks
    for k, name in enumerate([None, "all-r8", "attn-r4", None, "all-r8"]):
        before = engine.stats().prefix_cache_hits
        run_all(engine, [(f"p{k}", long_prompt, name)])
        hits = engine.stats().prefix_cache_hits - before
        assert (hits > 0) == (k >= 3), (k, name, hits)  # only a repeat of the same adapter hits


def _write_adapter(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_refuses_rank_above_limit_and_unknown_modules(tiny, adapters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny, {"attn-r4": adapters["attn-r4"]}, max_lora_rank=8)
    lora = engine.lora
    assert lora is not None
    with pytest.raises(LoRAError, match="rank 16 exceeds --max-lora-rank 8"):
        lora.register("big", str(adapters["mlp-r16"]))
    bad = {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj", "lm_head"], "peft_type": "LORA"}
    with pytest.raises(LoRAError, match="target module 'lm_head' does not exist"):
        lora.register("head", str(_write_adapter(tmp_path / "head", bad, {})))
    key = "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"
    cfg = dict(bad, target_modules=".*rotary")
    folder = _write_adapter(tmp_path / "rot", cfg, {key: torch.zeros(2, 64)})
    with pytest.raises(LoRAError, match="targets a module this model does not have"):
        lora.register("rot", str(folder))
    with pytest.raises(LoRAError, match="not a folder"):
        lora.register("gone", str(tmp_path / "missing"))
    with pytest.raises(LoRAError, match="already been loaded"):
        lora.register("attn-r4", str(adapters["attn-r4"]))
    assert sorted(lora.registry) == ["attn-r4"]  # nothing left behind


def test_flags_parse_vllm_forms(tmp_path: Path) -> None:
    spec = json.dumps({"name": "sql", "path": "/a", "base_model_name": "m"})
    config = EngineConfig(enable_lora=True, lora_modules=("code=/b", spec))
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_module_specs] == [
        ("code", "/b", None),
        ("sql", "/a", "m"),
    ]
    with pytest.raises(ValueError, match="name=path"):
        EngineConfig(enable_lora=True, lora_modules=("nopath",))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineConfig(lora_modules=("a=/b",))
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    assert LoRARequest("a", 1, "/p").base_model_name is None


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_each_adapters_output(  # type: ignore[no-untyped-def]
    tiny, adapters, prompts, references, method
) -> None:
    """Guesses (prompt lookup, or the base model as a draft proposing for the base) verified
    with each request's adapter leave every output equal to peft's merged weights."""
    spec: dict[str, object] = {"num_speculative_tokens": 3, "disable_by_batch_size": None}
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec.update(ngram if method == "ngram" else {"model": str(tiny)})
    engine = make_engine(tiny, adapters, speculative_config=spec)
    names: list[str | None] = [None, *adapters]
    jobs = [(f"{n}-{i}", p, n) for n in names for i, p in enumerate(prompts)]
    done = run_all(engine, jobs)
    for n in names:
        assert [done[f"{n}-{i}"] for i in range(len(prompts))] == references[n]
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    if method == "draft":  # the base's guesses: most fit the base requests, fewer the others
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_adapters_on_fp8_projections_keep_their_own_outputs(tiny, adapters, prompts) -> None:  # type: ignore[no-untyped-def]
    """``--quantization fp8``: the base projections run in e4m3, each adapter's delta is added
    in the model's dtype on top. PEFT's float references do not hold exactly; what must: each
    adapter's output in a mixed batch equals its output alone, and differs from the base's."""
    settings: dict[str, object] = dict(
        model=str(tiny), device="cpu", dtype="float32", enable_lora=True, max_loras=4,
        max_lora_rank=16, kv_cache_memory="64MiB", quantization="fp8",
        lora_modules=tuple(f"{n}={p}" for n, p in adapters.items()),
    )  # fmt: skip
    source = ModelSource("tiny", tiny, "hf")
    loaded = load_model(source, torch.float32, "cpu", quantization="fp8")
    engine = LLMEngine(EngineConfig(**settings), loaded)  # type: ignore[arg-type]
    assert loaded.model.model.layers[0].self_attn.qkv_proj.fp8 is not None
    names: list[str | None] = [None, *adapters]
    alone = {}
    for n in names:
        got = run_all(engine, [(f"alone-{n}-{i}", p, n) for i, p in enumerate(prompts)])
        alone[n] = [got[f"alone-{n}-{i}"] for i in range(len(prompts))]
    mixed = run_all(engine, [(f"{n}-{i}", p, n) for n in names for i, p in enumerate(prompts)])
    for n in names:
        assert [mixed[f"{n}-{i}"] for i in range(len(prompts))] == alone[n], n
    assert all(alone[n] != alone[None] for n in adapters)
