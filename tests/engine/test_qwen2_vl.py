"""A Qwen2-VL model (dynamic-resolution tower + M-RoPE Qwen2) answers as transformers' does.

A tiny random Qwen2-VL is built at test time (tests/tiny_qwen2_vl.py) and saved with
transformers' ``save_pretrained``. The references come from transformers'
``Qwen2VLForConditionalGeneration.generate`` on the inputs transformers' own processing steps
make (tests/tiny_qwen2_vl.py ``reference_inputs``); the engine gets the same conversation
through its own path (engine/multimodal.py, engine/models/qwen2_vl.py). Greedy tokens must be
equal, and so must the prompt lengths.

Every test runs twice: on the tiny Qwen2-VL, and on a tiny Qwen2.5-VL (the same decoder and
processor, its windowed vision tower: engine/models/qwen2_5_vl.py) against transformers'
``Qwen2_5_VLForConditionalGeneration``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from tiny_qwen2_vl import MAX_PIXELS, MIN_PIXELS, reference_inputs, reference_model

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.multimodal import ImageError, attach_images, mrope_positions
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from portico.contract import qwen2_vl_image_tokens
from portico.registry import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 12
LONG_TEXT = " ".join(f"word{i} and some more text about picture number {i}." for i in range(30))


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def folder(request: pytest.FixtureRequest) -> Path:
    name = {"qwen2-vl": "tiny_qwen2_vl_dir", "qwen2.5-vl": "tiny_qwen2_5_vl_dir"}[request.param]
    return Path(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(ModelSource("tiny-qwen2-vl", folder, "hf"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    return reference_model(folder)


def picture(seed: int, size: tuple[int, int] = (84, 56)) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def conversation(text: str, num_images: int) -> list[dict[str, Any]]:
    """Text before, between and after the images: the template keeps the message's order."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Look:"}]
    for _ in range(num_images):
        parts += [{"type": "image"}, {"type": "text", "text": "and"}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_reference(
    folder: Path, hf_model: Any, text: str, images: list[Any]
) -> tuple[int, list[int]]:
    """transformers' prompt length and greedy new tokens for this conversation."""
    inputs = reference_inputs(folder, conversation(text, len(images)), images)
    with torch.no_grad():
        out = hf_model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    length = inputs["input_ids"].shape[1]
    return length, out[0, length:].tolist()


def engine_inputs(
    loaded: LoadedModel, text: str, images: list[Any], options: dict[str, Any] | None = None
) -> tuple[list[int], Any]:
    tok = loaded.tokenizer
    rendered = tok.apply_chat_template(
        conversation(text, len(images)), tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    return attach_images(ids, images, loaded.image_processor, loaded.model, options)


def run(
    engine: LLMEngine, requests: list[tuple[list[int], Any, str | None]]
) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (ids, images, salt) in enumerate(requests):
        engine.add_request(f"r{i}", ids, params, cache_salt=salt, mm_inputs=tuple(images))
    done: dict[str, RequestOutput] = {}
    while len(done) < len(requests):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(requests))]


def make_engine(loaded: LoadedModel, **overrides: Any) -> LLMEngine:
    config = EngineConfig(model="tiny-qwen2-vl", device="cpu", dtype="float32", **overrides)
    return LLMEngine(config, loaded)


def test_image_rows_equal_transformers(folder: Path, loaded: LoadedModel, hf_model: Any) -> None:
    inputs = reference_inputs(folder, conversation("x", 1), [picture(0, (90, 61))])
    grid = inputs["image_grid_thw"]
    with torch.no_grad():
        theirs = hf_model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=grid
        ).pooler_output[0]
        t, h, w = (int(x) for x in grid[0])
        ours = loaded.model.encode_image(inputs["pixel_values"], (t, h // 2, w // 2))
    assert ours.shape == theirs.shape == (t * h * w // 4, 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_mrope_positions_equal_transformers(folder: Path, hf_model: Any) -> None:
    images = [picture(1), picture(2, (61, 90))]
    inputs = reference_inputs(folder, conversation("Compare.", 2), images)
    theirs, delta = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    loaded_like = load_model(ModelSource("q", folder, "hf"), torch.float32, "cpu")
    ids, mm = engine_inputs(loaded_like, "Compare.", images)
    rows, ours_delta = mrope_positions(len(ids), mm)
    assert rows == theirs[:, 0].tolist()
    assert ours_delta == int(delta[0, 0]) < 0  # images compress positions


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("What is in this picture?", [(84, 56)]),
        ("Compare the two pictures.", [(84, 56), (61, 90)]),
        (LONG_TEXT, [(84, 56)]),
        ("An odd size.", [(101, 67)]),
    ],
    ids=["one-image", "two-images", "image-and-long-text", "odd-size"],
)
def test_greedy_matches_transformers(
    folder: Path, loaded: LoadedModel, hf_model: Any, text: str, sizes: list[tuple[int, int]]
) -> None:
    images = [picture(seed, size) for seed, size in enumerate(sizes)]
    length, expected = hf_reference(folder, hf_model, text, images)
    ids, mm = engine_inputs(loaded, text, images)
    assert len(ids) == length  # usage: the engine counts what transformers feeds the model
    assert [image.length for image in mm] == [
        qwen2_vl_image_tokens(
            loaded.config.multimodal or {}, im.height, im.width, MIN_PIXELS, MAX_PIXELS
        )
        for im in images
    ]  # the gateway's rule (portico/contract.py) counts what the engine expands
    # A small token budget: the prompt (and its images) is prefilled over several chunks.
    engine = make_engine(loaded, max_num_batched_tokens=16, max_num_seqs=4)
    [out] = run(engine, [(ids, mm, None)])
    assert len(out.prompt_token_ids) == length
    assert out.outputs[0].token_ids == expected


def test_cached_image_hits_the_prefix_cache_and_still_matches(
    folder: Path, loaded: LoadedModel, hf_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = [picture(7)]
    text = "Describe it in detail, with every colour, shape and texture you can see there."
    _, expected = hf_reference(folder, hf_model, text, images)
    engine = make_engine(loaded)
    encoded: list[tuple[int, int, int]] = []
    original = loaded.model.encode_image

    def counting(pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        encoded.append(grid)
        return original(pixels, grid)

    monkeypatch.setattr(loaded.model, "encode_image", counting)
    [first] = run(engine, [(*engine_inputs(loaded, text, images), None)])
    [again] = run(engine, [(*engine_inputs(loaded, text, images), None)])
    _, mm = engine_inputs(loaded, text, images)
    assert again.num_cached_tokens >= mm[0].end  # the image's blocks came from the cache
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    assert len(encoded) == 1


def test_preempted_request_recomputes_the_same_tokens(
    folder: Path, loaded: LoadedModel, hf_model: Any
) -> None:
    """Few KV blocks: requests preempt each other (recompute), and each still matches."""
    texts = ["What is in this picture?", "Describe the colours.", "Count the shapes."]
    images = [[picture(10 + i)] for i in range(3)]
    expected = [
        hf_reference(folder, hf_model, t, im)[1] for t, im in zip(texts, images, strict=True)
    ]
    engine = make_engine(loaded, num_gpu_blocks_override=8, max_num_seqs=3)
    outs = run(
        engine, [(*engine_inputs(loaded, t, im), None) for t, im in zip(texts, images, strict=True)]
    )
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0


def test_max_pixels_changes_the_resize(folder: Path, loaded: LoadedModel, hf_model: Any) -> None:
    image = picture(4, (112, 112))
    ids_default, mm_default = engine_inputs(loaded, "Describe it.", [image])
    ids_small, mm_small = engine_inputs(
        loaded, "Describe it.", [image], {"max_pixels": 28 * 28 * 4}
    )
    assert mm_default[0].length == 16 and mm_small[0].length == 4
    assert len(ids_small) == len(ids_default) - 12
    [out] = run(make_engine(loaded), [(ids_small, mm_small, None)])
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_pixels": "big"}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 0}, "mm_processor_kwargs.min_pixels"),
        ({"max_pixels": 28 * 28 * 20000}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "mm_processor_kwargs"),
        ({"fps": 2}, "mm_processor_kwargs.fps"),
    ],
)
def test_bad_mm_processor_kwargs_name_the_field(
    loaded: LoadedModel, options: dict[str, Any], param: str
) -> None:
    with pytest.raises(ImageError) as caught:
        engine_inputs(loaded, "Describe it.", [picture(5)], options)
    assert caught.value.param == param


def test_dummy_weights_load_in_the_folders_shape(folder: Path) -> None:
    dummy = load_model(
        ModelSource("tiny-qwen2-vl", folder, "hf"), torch.float32, "cpu", load_format="dummy"
    )
    assert torch.equal(dummy.model.visual.merger.ln_q.weight, torch.ones(32))
    engine = make_engine(dummy, load_format="dummy")
    ids, mm = engine_inputs(dummy, "Describe it.", [picture(9)])
    [out] = run(engine, [(ids, mm, None)])
    assert len(out.outputs[0].token_ids) == MAX_TOKENS


def test_mrope_angles_equal_transformers(loaded: LoadedModel, hf_model: Any) -> None:
    """Each frequency of a token rotates by its section's row (temporal, height, width)."""
    positions = torch.randint(0, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    ours = loaded.model.rotary_emb.lookup(positions, torch.float32)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf_model.model.language_model.rotary_emb(x, positions.unsqueeze(1))
    half = cos.shape[-1] // 2
    torch.testing.assert_close(ours.cos[:, 0], cos[0, :, :half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin[:, 0], sin[0, :, :half], rtol=1e-6, atol=1e-6)


def test_first_token_logprobs_equal_transformers(
    folder: Path, loaded: LoadedModel, hf_model: Any
) -> None:
    """Closer than greedy tokens: the first sampled token's log-probabilities (two images,
    prefilled in chunks that cut through them) equal transformers' within float32 noise."""
    images = [picture(11, (101, 67)), picture(12, (61, 90))]
    text = "Compare the two pictures."
    inputs = reference_inputs(folder, conversation(text, 2), images)
    with torch.no_grad():
        logits = hf_model(**inputs).logits[0, -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    ids, mm = engine_inputs(loaded, text, images)
    engine = make_engine(loaded, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    engine.add_request("r0", ids, params, mm_inputs=tuple(mm))
    outs: list[RequestOutput] = []
    while not outs:
        outs = [o for o in engine.step() if o.finished]
    top = outs[0].outputs[0].logprobs[0].top_logprobs
    assert [t for t, _ in top] == expected.topk(5).indices.tolist()
    torch.testing.assert_close(
        torch.tensor([lp for _, lp in top]), expected.topk(5).values, rtol=0, atol=1e-4
    )


def test_the_cuda_kernel_choice_gives_the_same_tokens(folder: Path) -> None:
    """The CUDA path on a CPU (Triton interpreted, in a subprocess: TRITON_INTERPRET must be
    set before triton is imported): M-RoPE's per-token rows through the RoPE reference and
    the Triton attention give the CPU path's greedy tokens."""
    from tests.engine.cuda_choice import run_interpreted
    from tests.engine.qwen2_vl_triton_check import run_scenario

    triton = run_interpreted(Path(__file__).with_name("qwen2_vl_triton_check.py"), str(folder))
    assert triton["attention"] == "triton"
    cpu = run_scenario(folder)
    assert cpu["attention"] == "cpu"
    assert triton["tokens"] == cpu["tokens"] and len(cpu["tokens"]) == 12


def test_the_original_flat_config_layout_reads_the_same(folder: Path) -> None:
    """Qwen/Qwen2-VL-*-Instruct's own config.json is flat (the decoder's numbers at the top,
    ``rope_scaling: {"type": "mrope", ...}``): it reads as transformers 5's nested layout."""
    import json

    from engine.model_config import ModelConfig

    nested = json.loads((folder / "config.json").read_text())
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update(text, rope_theta=rope["rope_theta"], model_type="qwen2_vl")
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    a, b = ModelConfig.from_hf(nested), ModelConfig.from_hf(flat)
    assert (
        (a.multimodal or {})["mrope_section"] == (b.multimodal or {})["mrope_section"] == [2, 3, 3]
    )
    assert a.rope_scaling is None and b.rope_scaling is None and a.qkv_bias and b.qkv_bias
    keep = ("hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_theta", "vocab_size")
    assert [getattr(a, k) for k in keep] == [getattr(b, k) for k in keep]


@pytest.mark.parametrize("patches", [(1, 4, 6), (1, 8, 8), (1, 10, 14), (1, 6, 20)])
def test_window_order_equals_transformers(patches: tuple[int, int, int]) -> None:
    """Qwen2.5-VL's windows (engine/models/qwen2_5_vl.py): the same reordering and window
    sizes as transformers' ``get_vision_window_index``, squares cut short at the edges
    included."""
    from transformers.vision_utils import get_vision_window_index

    from engine.models.qwen2_5_vl import window_order

    order, sizes = window_order(patches, 2, 2)
    theirs, cu = get_vision_window_index(
        torch.tensor([patches]), spatial_merge_size=2, window_size=56, patch_size=14
    )
    assert order.tolist() == theirs.tolist()
    assert sizes == torch.diff(cu).tolist()


def test_a_released_qwen2_5_vl_config_builds_transformers_tower_shapes() -> None:
    """Qwen/Qwen2.5-VL-3B-Instruct's config.json layout (flat, ``rope_scaling`` mrope, the
    vision config's own names): our tower has the parameters, under the loader's names and of
    the shapes, that transformers' model has for it (both built on the meta device), so such a
    checkpoint's tensors land in place; the window settings read as transformers reads them."""
    import transformers

    from engine.model_config import ModelConfig
    from engine.model_loader import _model_class
    from engine.models.qwen2_vl import rename_qwen2_vl_weights

    vision = {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    }  # fmt: skip
    flat = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True, "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_config": vision,
    }  # fmt: skip
    cfg = ModelConfig.from_hf(flat)
    with torch.device("meta"):
        ours = _model_class(cfg)(cfg)
        theirs = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig(**flat)
        )
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters() if n.startswith("visual.")}
    expected = {
        name: tuple(p.shape)
        for n, p in theirs.named_parameters()
        if (name := rename_qwen2_vl_weights(n) or "").startswith("visual.")
    }
    assert shapes == expected and len(shapes) > 300
    window = ours.vision
    assert (window.window_size, window.fullatt_block_indexes) == (112, (7, 15, 23, 31))
    assert (window.embed_dim, window.out_dim, window.mrope_section) == (1280, 2048, (16, 24, 24))
