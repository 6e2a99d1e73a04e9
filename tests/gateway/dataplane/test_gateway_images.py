"""Images through the real gateway: ``portico serve`` in front of a tiny LLaVA engine, a Redis
of the module's own, the real `openai` client.

Proves: an image request is answered and its usage counts the image tokens (equal to
transformers' input length); a bad image part is a 400 naming it before admission, with every
counter unchanged even for a tenant whose budget is spent; too many images (the engine's
``--limit-mm-per-prompt image=2``) is the engine's 400 and gives back the request it was
charged; two tenants sending the same picture never share its cached blocks.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import yaml
from PIL import Image

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine
from tests.gateway.dataplane.test_gateway_check_order import counters, post

pytestmark = pytest.mark.slow

# standard: images on every model; text-only: none; elsewhere: images on another model only
PLANS = {
    "default_plan": "standard",
    "plans": {
        "standard": {},
        "text-only": {"image_models": []},
        "elsewhere": {"image_models": ["another-model"]},
    },
}
TEXT = "Describe this picture in detail, every colour and shape that you can see in it please."


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(module_tmp / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, store: RedisServer, tiny_llava_dir: Path) -> Iterator[GatewayProcess]:
    engine = tiny_engine(tiny_llava_dir, "vision")
    engine["args"] = [*engine["args"], "--limit-mm-per-prompt", "image=2"]
    plans = module_tmp / "plans.yaml"
    plans.write_text(yaml.safe_dump(PLANS))
    gw = GatewayProcess(
        module_tmp,
        {"redis": {"url": store.url, "plans_file": str(plans)}, "engines": [engine]},
        {},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def picture(seed: int) -> tuple[Image.Image, str]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (30, 40, 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), url


def messages(urls: list[str], text: str = TEXT) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def transformers_length(folder: Path, images: list[Image.Image]) -> int:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(folder))
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    return int(processor(text=prompt, images=images, return_tensors="pt")["input_ids"].shape[1])


def test_an_image_request_is_answered_and_its_tokens_counted(
    gateway: GatewayProcess, tiny_llava_dir: Path
) -> None:
    _, key = gateway.create_tenant()
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    image, url = picture(1)
    reply = client.chat.completions.create(
        model="vision", messages=messages([url]), max_tokens=4, temperature=0
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == transformers_length(tiny_llava_dir, [image])


def test_bad_image_parts_are_400_before_a_spent_budget(
    gateway: GatewayProcess, store: RedisServer
) -> None:
    tenant_id, key = gateway.create_tenant(overrides={"requests_per_minute": 100, "budget_usd": 0})
    not_image = "data:image/png;base64," + base64.b64encode(b"no picture here").decode()
    before = counters(store, tenant_id)
    for url, words in [("data:image/png;base64,%%%", "base64"), (not_image, "not a PNG")]:
        r = post(gateway, key, {"model": "vision", "messages": messages([url]), "max_tokens": 4})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (
            error["param"] == "messages[0].content[0].image_url.url" and words in error["message"]
        )
    assert counters(store, tenant_id) == before  # no bucket, slot or budget moved


def test_too_many_images_is_the_engines_400_and_gives_the_request_back(
    gateway: GatewayProcess,
) -> None:
    _, key = gateway.create_tenant(overrides={"requests_per_minute": 5})
    _, url = picture(2)
    r = post(gateway, key, {"model": "vision", "messages": messages([url] * 3), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    ok = post(gateway, key, {"model": "vision", "messages": messages([url]), "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "4"  # the refused one was given back


def test_tenants_never_share_a_cached_image(gateway: GatewayProcess) -> None:
    _, url = picture(3)
    body = {"model": "vision", "messages": messages([url]), "max_tokens": 2, "temperature": 0}

    def cached(key: str) -> int:
        r = httpx.post(
            gateway.base_url + "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {key}"}, timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    _, first = gateway.create_tenant()
    _, second = gateway.create_tenant()
    assert cached(first) == 0
    assert cached(first) >= 16  # the same tenant again: its image's blocks are cached
    assert cached(second) == 0  # another tenant: none of them


@pytest.mark.parametrize("plan", ["text-only", "elsewhere"])
def test_a_plan_without_images_for_the_model_is_403_before_admission(
    gateway: GatewayProcess, store: RedisServer, plan: str
) -> None:
    tenant_id, key = gateway.create_tenant(plan=plan, overrides={"requests_per_minute": 5})
    _, url = picture(4)
    before = counters(store, tenant_id)
    r = post(gateway, key, {"model": "vision", "messages": messages([url]), "max_tokens": 2})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "images_not_allowed" and error["param"] == "messages"
    assert counters(store, tenant_id) == before
    text = [{"role": "user", "content": "Just text."}]
    ok = post(gateway, key, {"model": "vision", "messages": text, "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # the plan may still use the model without images
