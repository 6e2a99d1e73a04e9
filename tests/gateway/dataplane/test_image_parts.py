"""Image parts at the gateway: data URLs checked before admission (400 naming the part), and
image tokens counted as the engine counts them (the tiny LLaVA's 16 per image)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from gateway.admission.prompt_tokens import (
    IMAGE_TOKEN_ESTIMATE,
    PromptCounter,
    load_image_tokens,
    load_tokenizer,
)
from gateway.body.fields import parse_fields
from portico.errors import InvalidRequestError


def data_url(fmt: str) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 12), (200, 30, 90)).save(buffer, format=fmt)
    mime = fmt.lower()
    return f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def chat(content: list[dict[str, object]]) -> bytes:
    return json.dumps({"model": "v", "messages": [{"role": "user", "content": content}]}).encode()


def image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_passes(fmt: str) -> None:
    fields = parse_fields(chat([image(data_url(fmt)), {"type": "text", "text": "hi"}]), "chat")
    assert fields.messages is not None and len(fields.messages) == 1


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"just some text").decode(), "not a PNG"),
        ("ftp://example.com/cat.png", "expected a data URL"),
        ("data:text/plain;base64,aGk=", "expected a data URL"),
    ],
    ids=["bad-base64", "not-an-image", "other-scheme", "not-image-mime"],
)
def test_bad_image_urls_are_400_naming_the_part(url: str, words: str) -> None:
    body = chat([{"type": "text", "text": "look"}, image(url)])
    with pytest.raises(InvalidRequestError) as caught:
        parse_fields(body, "chat")
    assert caught.value.param == "messages[0].content[1].image_url.url"
    assert words in caught.value.message


def test_http_urls_pass_to_the_upstream() -> None:
    fields = parse_fields(chat([image("https://example.com/cat.png")]), "chat")
    assert fields.messages is not None


def test_image_tokens_count_as_the_engine_counts_them(tiny_llava_dir: Path) -> None:
    """The tiny LLaVA: the engine's prompt (its own test checks it equals transformers')
    is the template's tokens with each image's placeholder grown to 16 tokens."""
    from transformers import AutoProcessor

    per_image = load_image_tokens(str(tiny_llava_dir))
    assert per_image == 16
    tok = load_tokenizer(str(tiny_llava_dir))
    counter = PromptCounter({"v": tok}, {"v": per_image})
    url = data_url("PNG")
    content = [image(url), image(url), {"type": "text", "text": "Compare them."}]
    fields = parse_fields(chat(content), "chat")
    processor = AutoProcessor.from_pretrained(str(tiny_llava_dir))
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    pictures = [Image.new("RGB", (20, 12))] * 2
    expected = processor(text=prompt, images=pictures, return_tensors="pt")["input_ids"].shape[1]
    assert counter.count("v", fields) == expected
    text_only = parse_fields(chat([{"type": "text", "text": "Compare them."}]), "chat")
    # each image: its 16 tokens (and the template's text around the placeholder)
    assert counter.count("v", fields) - counter.count("v", text_only) >= 2 * 16


@pytest.mark.parametrize("strategy", ["full", "default"])
def test_siglip_image_tokens_count_as_transformers_counts_them(
    strategy: str, tiny_llava_siglip_dir: Path, tmp_path: Path
) -> None:
    """A SigLIP tower has no CLS row: 16 patches fill 16 positions under "full" and 15 under
    "default" (transformers drops the first row whichever the tower); the gateway's count of a
    whole prompt equals the input transformers' own LlavaProcessor makes."""
    from tiny_llava import build_tiny_llava
    from transformers import AutoProcessor

    folder = tiny_llava_siglip_dir
    if strategy == "default":
        folder = build_tiny_llava(tmp_path / "siglip-default", tower="siglip", strategy=strategy)
    per_image = load_image_tokens(str(folder))
    assert per_image == (16 if strategy == "full" else 15)
    counter = PromptCounter({"v": load_tokenizer(str(folder))}, {"v": per_image})
    content = [image(data_url("PNG")), {"type": "text", "text": "What is it?"}]
    processor = AutoProcessor.from_pretrained(str(folder))
    parts = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    inputs = processor(text=prompt, images=[Image.new("RGB", (20, 12))], return_tensors="pt")
    assert counter.count("v", parse_fields(chat(content), "chat")) == inputs["input_ids"].shape[1]


def test_images_of_an_unknown_model_are_estimated() -> None:
    fields = parse_fields(
        chat([image(data_url("PNG")), {"type": "text", "text": "x" * 40}]), "chat"
    )
    assert PromptCounter({}).count("remote", fields) == 10 + IMAGE_TOKEN_ESTIMATE
    assert load_image_tokens("/no/such/model") is None


def picture_url(size: tuple[int, int], seed: int) -> tuple[Image.Image, str]:
    picture = Image.new("RGB", size, (seed * 40 % 256, 30, 90))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return picture, f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


@pytest.mark.parametrize("folder", ["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir"])
@pytest.mark.parametrize(
    "options", [None, {"max_pixels": 28 * 28 * 4}], ids=["folder", "max_pixels"]
)
def test_qwen2_vl_images_count_by_their_size(
    request: pytest.FixtureRequest, folder: str, options: object
) -> None:
    """The tiny Qwen2-VL and Qwen2.5-VL: each picture fills as many tokens as its resized
    grid holds (portico/contract.py's rule), so two odd-sized pictures count what
    transformers' own processing feeds the model."""
    from tiny_qwen2_vl import reference_inputs

    tiny_qwen2_vl_dir = Path(request.getfixturevalue(folder))
    rule = load_image_tokens(str(tiny_qwen2_vl_dir))
    counter = PromptCounter({"v": load_tokenizer(str(tiny_qwen2_vl_dir))}, {"v": rule})
    (first, first_url), (second, second_url) = picture_url((101, 67), 1), picture_url((61, 90), 2)
    content = [image(first_url), {"type": "text", "text": "and"}, image(second_url)]
    body = {"model": "v", "messages": [{"role": "user", "content": content}]}
    if options is not None:
        body["mm_processor_kwargs"] = options
    fields = parse_fields(json.dumps(body).encode(), "chat")
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    expected = reference_inputs(
        tiny_qwen2_vl_dir, [{"role": "user", "content": parts}], [first, second], options
    )["input_ids"].shape[1]
    assert counter.count("v", fields) == expected


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_pixels": 0}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": "many"}, "mm_processor_kwargs.min_pixels"),
        ({"min_pixels": 9000, "max_pixels": 800}, "mm_processor_kwargs"),
        ([1, 2], "mm_processor_kwargs"),
    ],
)
def test_bad_mm_processor_kwargs_are_400s_before_admission(options: object, param: str) -> None:
    body = {"model": "v", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InvalidRequestError) as caught:
        parse_fields(json.dumps({**body, "mm_processor_kwargs": options}).encode(), "chat")
    assert caught.value.param == param


@pytest.mark.parametrize(
    "pre",
    [
        {"min_pixels": 3136, "max_pixels": 12845056},
        {"size": {"shortest_edge": 3136, "longest_edge": 12845056}},
    ],
    ids=["qwen-top-level", "transformers-5"],
)
def test_qwen2_vl_pixel_bounds_read_as_transformers_reads_them(
    tiny_qwen2_vl_dir: Path, tmp_path: Path, pre: dict[str, object]
) -> None:
    """Qwen's own preprocessor_config.json layouts and transformers 5's give the gateway the
    bounds the engine's image processor (transformers') uses."""
    from transformers import AutoImageProcessor

    (tmp_path / "config.json").write_text((tiny_qwen2_vl_dir / "config.json").read_text())
    base = json.loads((tiny_qwen2_vl_dir / "preprocessor_config.json").read_text())
    base.pop("size")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**base, **pre}))
    rule = load_image_tokens(str(tmp_path))
    theirs = AutoImageProcessor.from_pretrained(str(tmp_path)).size
    assert rule is not None and not isinstance(rule, int)
    assert (rule.min_pixels, rule.max_pixels) == (theirs["shortest_edge"], theirs["longest_edge"])
    assert (rule.min_pixels, rule.max_pixels) == (3136, 12845056)
