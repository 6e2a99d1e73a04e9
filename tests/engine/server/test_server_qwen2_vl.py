"""Qwen2-VL through a real `portico engine` process with the real `openai` client: a data-URL
image (of an odd size, not a multiple of 28) answers as transformers' own greedy generate
does, usage counts its size-dependent image tokens, and ``mm_processor_kwargs`` changes the
resize or is a 400 naming the field. Every test runs on the tiny Qwen2-VL and on the tiny
Qwen2.5-VL (its windowed tower)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from engine_server_process import MODEL_NAME, EngineProcess
from PIL import Image
from tiny_qwen2_vl import reference_inputs, reference_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def folder(request: pytest.FixtureRequest) -> Path:
    name = {"qwen2-vl": "tiny_qwen2_vl_dir", "qwen2.5-vl": "tiny_qwen2_5_vl_dir"}[request.param]
    return Path(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("qwen2-vl-logs")
    # A small step budget: the prompt (and the image) is prefilled in chunks.
    process = EngineProcess(folder, logs / "engine.log", extra=["--max-num-batched-tokens", "16"])
    try:
        process.wait_ready()
        yield process
    finally:
        assert process.stop() == 0, process.logs()


@pytest.fixture(scope="module")
def client(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


def picture(seed: int, size: tuple[int, int]) -> tuple[Image.Image, str]:
    """A random picture (width, height) and its PNG data URL."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def content(url: str, text: str) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "Look:"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text},
    ]


def hf_reference(folder: Path, text: str, image: Image.Image) -> tuple[int, str]:
    """transformers' prompt length and greedy continuation's text."""
    from transformers import AutoTokenizer

    parts = [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": text}]
    inputs = reference_inputs(folder, [{"role": "user", "content": parts}], [image])
    model = reference_model(folder)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    length = inputs["input_ids"].shape[1]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return length, tokenizer.decode(out[0, length:], skip_special_tokens=True)


def test_an_odd_sized_image_answers_as_transformers_does(
    client: openai.OpenAI, folder: Path
) -> None:
    image, url = picture(1, (101, 67))
    text = "What is in this picture?"
    length, expected = hf_reference(folder, text, image)
    assert expected  # random weights still say something: the comparison has teeth
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content(url, text)}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].message.content == expected
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == length
    assert resp.usage.completion_tokens == MAX_TOKENS


def test_max_pixels_shrinks_the_image_tokens(client: openai.OpenAI) -> None:
    _, url = picture(2, (112, 112))  # 16 image tokens at the folder's bounds
    messages = [{"role": "user", "content": content(url, "Describe it.")}]
    usage = []
    for extra in ({}, {"mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0, extra_body=extra
        )
        assert resp.usage is not None
        usage.append(resp.usage.prompt_tokens)
    assert usage[0] - usage[1] == 16 - 4


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"max_pixels": -5}, "mm_processor_kwargs.max_pixels"),
        ({"min_pixels": 10_000, "max_pixels": 1_000}, "mm_processor_kwargs"),
        ({"fps": 1}, "mm_processor_kwargs.fps"),
        ("big", "mm_processor_kwargs"),
    ],
)
def test_bad_mm_processor_kwargs_are_400s_naming_the_field(
    client: openai.OpenAI, options: Any, param: str
) -> None:
    _, url = picture(3, (60, 60))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content(url, "Hi")}],
            max_tokens=2, extra_body={"mm_processor_kwargs": options},
        )  # fmt: skip
    error = caught.value.body
    assert isinstance(error, dict) and error.get("param") == param, error
