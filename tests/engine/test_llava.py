"""A LLaVA model (CLIP or SigLIP tower + projector + Llama) answers as transformers' own does.

A tiny random LLaVA is built at test time (tests/tiny_llava.py) and saved with transformers'
``save_pretrained``. The references come from transformers' ``LlavaForConditionalGeneration``
``generate`` on the inputs transformers' own ``LlavaProcessor`` makes (chat template, image
token expansion, CLIP preprocessing); the engine gets the same conversation through its own
path (engine/multimodal.py). Greedy tokens must be equal, and so must the prompt lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.multimodal import attach_images
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from portico.registry import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_TOKENS = 12
LONG_TEXT = " ".join(f"word{i} and some more text about picture number {i}." for i in range(40))


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava_dir(request: pytest.FixtureRequest) -> Path:
    """Every test runs on both towers (tests/tiny_llava.py)."""
    name = "tiny_llava_dir" if request.param == "clip" else "tiny_llava_siglip_dir"
    return request.getfixturevalue(name)


@pytest.fixture(scope="module")
def loaded(llava_dir: Path) -> LoadedModel:
    return load_model(ModelSource("tiny-llava", llava_dir, "hf"), torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf_model(llava_dir: Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(llava_dir)).eval()


@pytest.fixture(scope="module")
def processor(llava_dir: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(llava_dir))


def picture(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def conversation(text: str, num_images: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_reference(
    hf_model: Any, processor: Any, text: str, images: list[Any]
) -> tuple[int, list[int]]:
    """transformers' prompt length and greedy new tokens for this conversation."""
    prompt = processor.apply_chat_template(
        conversation(text, len(images)), add_generation_prompt=True
    )
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    length = inputs["input_ids"].shape[1]
    return length, out[0, length:].tolist()


def engine_inputs(loaded: LoadedModel, text: str, images: list[Any]) -> tuple[list[int], Any]:
    tok = loaded.tokenizer
    rendered = tok.apply_chat_template(
        conversation(text, len(images)), tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    return attach_images(ids, images, loaded.image_processor, loaded.model)


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
    config = EngineConfig(model="tiny-llava", device="cpu", dtype="float32", **overrides)
    return LLMEngine(config, loaded)


def test_image_rows_equal_transformers(loaded: LoadedModel, hf_model: Any) -> None:
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = loaded.model.encode_images(pixels)
        theirs = hf_model.get_image_features(pixel_values=pixels).pooler_output
    assert ours.shape == (2, 16, 64)
    torch.testing.assert_close(ours, torch.stack(list(theirs)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("text", "num_images"),
    [("What is in this picture?", 1), ("Compare the two pictures.", 2), (LONG_TEXT, 1)],
    ids=["one-image", "two-images", "image-and-long-text"],
)
def test_greedy_matches_transformers(
    loaded: LoadedModel, hf_model: Any, processor: Any, text: str, num_images: int
) -> None:
    images = [picture(seed) for seed in range(num_images)]
    length, expected = hf_reference(hf_model, processor, text, images)
    ids, mm = engine_inputs(loaded, text, images)
    assert len(ids) == length  # usage: the engine counts what transformers feeds the model
    # A small token budget: the long prompt's image is prefilled over several chunks.
    engine = make_engine(loaded, max_num_batched_tokens=24, max_num_seqs=4)
    [out] = run(engine, [(ids, mm, None)])
    assert out.outputs[0].token_ids == expected
    assert len(out.prompt_token_ids) == length


def test_cached_image_is_not_encoded_again(
    loaded: LoadedModel, hf_model: Any, processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's tokens lie in full blocks (the text after it fills one more), so the second
    request finds them all in the prefix cache and never runs the vision tower."""
    images = [picture(7)]
    text = "Describe it in detail, with every colour, shape and texture you can see there."
    _, expected = hf_reference(hf_model, processor, text, images)
    engine = make_engine(loaded)
    encoded: list[int] = []
    original = loaded.model.encode_images

    def counting(pixels: torch.Tensor) -> torch.Tensor:
        encoded.append(pixels.shape[0])
        return original(pixels)

    monkeypatch.setattr(loaded.model, "encode_images", counting)
    [first] = run(engine, [(*engine_inputs(loaded, text, images), None)])
    [again] = run(engine, [(*engine_inputs(loaded, text, images), None)])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    assert encoded == [1]  # the second request found every image token in the cache
    _, mm = engine_inputs(loaded, text, images)
    assert again.num_cached_tokens >= mm[0].end


def test_a_repeated_image_in_a_short_prompt_is_encoded_once_per_tenant(
    loaded: LoadedModel, hf_model: Any, processor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image's last block is not full, so the prefix cache cannot cover it: the encoder
    cache (keyed by tenant salt and image hash) does, for the same tenant only."""
    images, text = [picture(8)], "Describe it."
    _, expected = hf_reference(hf_model, processor, text, images)
    engine = make_engine(loaded)
    encoded: list[int] = []
    original = loaded.model.encode_images

    def counting(pixels: torch.Tensor) -> torch.Tensor:
        encoded.append(pixels.shape[0])
        return original(pixels)

    monkeypatch.setattr(loaded.model, "encode_images", counting)
    [a] = run(engine, [(*engine_inputs(loaded, text, images), "tenant-a")])
    [b] = run(engine, [(*engine_inputs(loaded, text, images), "tenant-a")])
    [c] = run(engine, [(*engine_inputs(loaded, text, images), "tenant-b")])
    _, mm = engine_inputs(loaded, text, images)
    assert b.num_cached_tokens < mm[0].end  # the prefix cache did not hold the whole image
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids == expected
    assert encoded == [1, 1]  # tenant-a once (its second request hit), tenant-b once


def test_other_image_never_shares_its_blocks(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    ids_a, mm_a = engine_inputs(loaded, "Describe it.", [picture(1)])
    ids_b, mm_b = engine_inputs(loaded, "Describe it.", [picture(2)])
    assert ids_a == ids_b  # the same placeholder tokens: only the image hash tells them apart
    run(engine, [(ids_a, mm_a, None)])
    [b] = run(engine, [(ids_b, mm_b, None)])
    block = engine.config.block_size
    assert b.num_cached_tokens == mm_b[0].offset // block * block  # only the text before it


def test_tenants_do_not_share_cached_images(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    ids, mm = engine_inputs(loaded, "Describe it.", [picture(3)])
    run(engine, [(ids, mm, "tenant-a")])
    [other] = run(
        engine, [(ids, engine_inputs(loaded, "Describe it.", [picture(3)])[1], "tenant-b")]
    )
    [same] = run(
        engine, [(ids, engine_inputs(loaded, "Describe it.", [picture(3)])[1], "tenant-a")]
    )
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens >= mm[0].end // 16 * 16


def test_dummy_weights_load_in_the_folders_shape(llava_dir: Path) -> None:
    """--load-format dummy: random weights (the vision tower's too), LayerNorm scales 1,
    so a benchmark runs images through a real-shaped tower without the checkpoint."""
    dummy = load_model(
        ModelSource("tiny-llava", llava_dir, "hf"), torch.float32, "cpu", load_format="dummy"
    )
    tower = dummy.model.vision_tower
    assert torch.equal(tower.post_layernorm.weight, torch.ones(32))  # both towers have one
    assert tower.embeddings.position_embedding.weight.abs().sum() > 0
    rows = dummy.model.encode_images(torch.randn(1, 3, 32, 32))
    assert rows.shape == (1, 16, 64) and torch.isfinite(rows).all()
    engine = make_engine(dummy, load_format="dummy")
    ids, mm = engine_inputs(dummy, "Describe it.", [picture(9)])
    [out] = run(engine, [(ids, mm, None)])
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
