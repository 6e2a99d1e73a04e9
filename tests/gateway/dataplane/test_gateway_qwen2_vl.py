"""Qwen2-VL through the real gateway: ``portico serve`` in front of a tiny Qwen2-VL engine, a
Redis of the module's own, the real `openai` client; every test again in front of a tiny
Qwen2.5-VL engine.

Proves: the gateway reserves exactly the prompt tokens the engine then reports for an
odd-sized image, with and without ``mm_processor_kwargs.max_pixels`` (the count follows each
picture's size: portico/contract.py's rule on both sides), and that count equals
transformers' input length; a bad ``mm_processor_kwargs`` is a 400 naming the field before
admission, with every counter unchanged.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from PIL import Image

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine
from tests.gateway.dataplane.test_gateway_check_order import counters, post

pytestmark = pytest.mark.slow

TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(module_tmp / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["qwen2-vl", "qwen2.5-vl"])
def folder(request: pytest.FixtureRequest) -> Path:
    name = {"qwen2-vl": "tiny_qwen2_vl_dir", "qwen2.5-vl": "tiny_qwen2_5_vl_dir"}[request.param]
    return Path(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, store: RedisServer, folder: Path) -> Iterator[GatewayProcess]:
    engine = tiny_engine(folder, "qwen-vision")
    home = module_tmp / folder.name
    home.mkdir()
    gw = GatewayProcess(home, {"redis": {"url": store.url}, "engines": [engine]}, {})
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def picture(seed: int, size: tuple[int, int]) -> tuple[Image.Image, str]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"), url


def messages(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("options", [None, {"max_pixels": 28 * 28 * 4}], ids=["folder", "small"])
def test_the_reservation_equals_the_engines_count_for_an_odd_sized_image(
    gateway: GatewayProcess, folder: Path, options: dict[str, int] | None
) -> None:
    from tiny_qwen2_vl import reference_inputs

    _, key = gateway.create_tenant()
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    image, url = picture(1, (101, 67))
    extra = {} if options is None else {"mm_processor_kwargs": options}
    raw = client.chat.completions.with_raw_response.create(
        model="qwen-vision", messages=messages(url), max_tokens=4, temperature=0,
        extra_body=extra,
    )  # fmt: skip
    usage = raw.parse().usage
    assert usage is not None
    reserved = int(raw.headers["x-ratelimit-limit-tokens"]) - int(
        raw.headers["x-ratelimit-remaining-tokens"]
    )
    assert reserved == usage.prompt_tokens + 4
    parts = [{"type": "image"}, {"type": "text", "text": TEXT}]
    inputs = reference_inputs(folder, [{"role": "user", "content": parts}], [image], options)
    assert usage.prompt_tokens == inputs["input_ids"].shape[1]


def test_bad_mm_processor_kwargs_are_400_before_admission(
    gateway: GatewayProcess, store: RedisServer
) -> None:
    tenant_id, key = gateway.create_tenant(overrides={"requests_per_minute": 100})
    _, url = picture(2, (60, 60))
    before = counters(store, tenant_id)
    body = {"model": "qwen-vision", "messages": messages(url), "max_tokens": 4}
    r = post(gateway, key, {**body, "mm_processor_kwargs": {"max_pixels": -1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "mm_processor_kwargs.max_pixels"
    assert counters(store, tenant_id) == before  # no bucket, slot or budget moved
