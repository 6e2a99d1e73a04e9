"""Image parts through a real `portico engine` serving a tiny random LLaVA, with the real
`openai` client: answers equal transformers' own greedy generate on the inputs transformers'
LlavaProcessor makes, usage counts every image token, and bad image parts are 400s in
OpenAI's shape naming the part, with nothing queued."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from engine_server_process import MODEL_NAME, EngineProcess, metric
from PIL import Image

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tiny_llava_dir: Path) -> Path:
    return tiny_llava_dir


@pytest.fixture(scope="module")
def client(llava_server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=llava_server.base_url + "/v1", api_key=llava_server.api_key, max_retries=0
    )


def picture(seed: int, fmt: str = "PNG") -> tuple[Image.Image, str]:
    """A random picture and its data URL in ``fmt``."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (36, 44, 3), generator=generator, dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    url = f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), url


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def hf_reference(llava_dir: Path, text: str, images: list[Image.Image]) -> tuple[int, str]:
    """transformers' prompt length and greedy continuation's text."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(llava_dir))
    model = LlavaForConditionalGeneration.from_pretrained(str(llava_dir)).eval()
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    length = inputs["input_ids"].shape[1]
    return length, processor.tokenizer.decode(out[0, length:], skip_special_tokens=True)


def test_two_images_answer_as_transformers_does(client: openai.OpenAI, llava_dir: Path) -> None:
    first, first_url = picture(1, "PNG")
    second, second_url = picture(2, "JPEG")
    text = "What differs between these two?"
    length, expected = hf_reference(llava_dir, text, [first, second])
    assert expected  # random weights still say something: the comparison has teeth
    content = [image_part(first_url), image_part(second_url), {"type": "text", "text": text}]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == length  # 2 x 16 image tokens included
    assert resp.usage.completion_tokens == MAX_TOKENS


def test_streamed_answer_equals_the_whole_one(client: openai.OpenAI) -> None:
    _, url = picture(3, "WEBP")
    messages = [{"role": "user", "content": [image_part(url), {"type": "text", "text": "Hi"}]}]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def total(samples: dict[Any, float], name: str) -> float:
    """A counter summed over all its labels (finish reasons, ...)."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def bad_parts() -> list[tuple[str, list[dict[str, Any]], str]]:
    _, url = picture(4)
    not_image = "data:image/png;base64," + base64.b64encode(b"plain text, no picture").decode()
    three = [image_part(url)] * 3
    return [
        ("bad-base64", [image_part("data:image/png;base64,@@not base64@@")],
         "messages[0].content[0].image_url.url"),
        ("not-an-image", [image_part(not_image)], "messages[0].content[0].image_url.url"),
        ("http-url", [{"type": "text", "text": "see"}, image_part("http://10.0.0.1/cat.png")],
         "messages[0].content[1].image_url.url"),
        ("too-many", three, "messages"),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "content", "param"), bad_parts(), ids=[c[0] for c in bad_parts()])
def test_bad_image_parts_are_400s_and_leave_nothing_behind(
    llava_server: EngineProcess, case: str, content: list[dict[str, Any]], param: str
) -> None:
    before = llava_server.metrics()
    with llava_server.client() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]},
        )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    after = llava_server.metrics()
    for name in ("vllm:prompt_tokens_total", "vllm:request_success_total"):
        assert total(after, name) == total(before, name)
    assert ("vllm:num_requests_running", (("model_name", MODEL_NAME),)) in after
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0


def test_a_text_model_refuses_images_naming_the_part() -> None:
    """No vision tower: a 400 naming the image part (what the tiny Llama's engine answers)."""
    from engine.server.chat_images import ChatImages
    from engine.server.protocol_chat import ChatMessage
    from portico.errors import InvalidRequestError

    _, url = picture(5)
    message = ChatMessage(role="user", content=[{"type": "text", "text": "hi"}, image_part(url)])
    with pytest.raises(InvalidRequestError) as caught:
        ChatImages(model=None, max_images=4).decode([message])
    assert caught.value.param == "messages[0].content[1].image_url.url"


def test_the_responses_api_takes_input_image_parts(client: openai.OpenAI) -> None:
    """Responses' ``input_image`` parts answer as the same chat request does."""
    _, url = picture(6, "GIF")
    text = "What is this?"
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [image_part(url), {"type": "text", "text": text}]}],
    )  # fmt: skip
    response = client.responses.create(
        model=MODEL_NAME, max_output_tokens=MAX_TOKENS, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": text},
        ]}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens > 16
