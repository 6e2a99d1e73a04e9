"""http(s) image URLs through the real gateway: ``portico serve`` with ``media:`` naming
``localhost`` (and 127.0.0.0/8 as an operator network), a tiny LLaVA engine, a Redis of the
module's own, a real local HTTP server of images, the real `openai` client.

Proves: an allowed URL is fetched by the gateway and answered exactly as the same image sent
as a data URL (the engine itself fetches nothing); a disallowed host, a private address, a
redirect to a disallowed host, an image too large, a server too slow, bytes that are not an
image: each a 400 naming the part, before admission, with no bucket, slot or budget moved.
The model's image price ($0.001 an image, on top of its tokens at $1 and $2 per 1M) is in the
usage's spend and the money budget, and admission refuses a request whose images the budget
left cannot pay for.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import RedisServer
from tests.gateway.dataplane.harness import GatewayProcess, tiny_engine, wait_until
from tests.gateway.dataplane.test_gateway_check_order import counters, post
from tests.gateway.dataplane.test_gateway_images import messages
from tests.gateway.dataplane.test_gateway_money import counted, new_key, oa, spend_key
from tests.media_server import MediaServer, png

pytestmark = pytest.mark.slow
PARAM = "messages[0].content[1].image_url.url"


@pytest.fixture(scope="module")
def images() -> Iterator[MediaServer]:
    server = MediaServer(png(7))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store(module_tmp: Path) -> Iterator[RedisServer]:
    server = RedisServer(module_tmp / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(module_tmp: Path, store: RedisServer, tiny_llava_dir: Path) -> Iterator[GatewayProcess]:
    media = {
        "allowed_domains": ["localhost", "10.20.30.40"],
        "allowed_networks": ["127.0.0.0/8", "::1/128"],
        "max_bytes": 64 * 1024,
        "fetch_timeout_s": 2.0,
    }
    engine = tiny_engine(tiny_llava_dir, "vision")
    gw = GatewayProcess(
        module_tmp,
        {
            "redis": {"url": store.url},
            "engines": [engine],
            "media": media,
            "pricing": {"vision": {"input": 1.0, "output": 2.0, "image": 0.001}},
        },
        {},
    )
    gw.start(timeout=600)
    yield gw
    assert gw.terminate() == 0, gw.log()


def two_parts(url: str) -> list[dict[str, object]]:
    """A text part first, so the image is the message's second part (``content[1]``)."""
    [message] = messages([url])
    parts = message["content"]
    return [{"role": "user", "content": [parts[1], parts[0]]}]


def test_an_allowed_url_answers_as_the_same_data_url(
    gateway: GatewayProcess, images: MediaServer
) -> None:
    _, key = gateway.create_tenant()
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)
    data_url = "data:image/png;base64," + base64.b64encode(images.image).decode()
    replies = [
        client.chat.completions.create(
            model="vision",
            messages=two_parts(url),
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        for url in (data_url, images.url("/cat.png"), images.url("/to-cat"))
    ]
    assert images.hits["/cat.png"] == 2  # fetched by the gateway, once per URL request
    first = replies[0]
    assert first.usage is not None and first.usage.prompt_tokens > 0
    for reply in replies[1:]:
        assert reply.choices[0].message.content == first.choices[0].message.content
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == first.usage.prompt_tokens
        assert reply.usage.completion_tokens == first.usage.completion_tokens
        # the same pixels: the engine's prefix cache holds the first request's image blocks
        details = reply.usage.prompt_tokens_details
        assert details is not None and (details.cached_tokens or 0) >= 16


@pytest.mark.parametrize(
    ("path", "host", "words"),
    [
        ("/cat.png", "127.0.0.1", "not an allowed media domain"),  # not named
        ("/cat.png", "10.20.30.40", "private"),  # named, but a private address
        ("/away", "localhost", "not an allowed media domain"),  # redirect elsewhere
        ("/big.png", "localhost", "larger than 65536 bytes"),
        ("/slow.png", "localhost", "longer than 2 s"),
        ("/page", "localhost", "not a PNG"),
    ],
)
def test_a_refused_fetch_is_a_400_naming_the_part_and_charges_nothing(
    gateway: GatewayProcess, store: RedisServer, images: MediaServer, path: str, host: str,
    words: str,
) -> None:  # fmt: skip
    tenant_id, key = gateway.create_tenant(overrides={"requests_per_minute": 5, "budget_usd": 1})
    before = counters(store, tenant_id)  # a fresh tenant: admission would make its buckets
    url = images.url(path, host)
    r = post(gateway, key, {"model": "vision", "messages": two_parts(url), "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == PARAM and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert counters(store, tenant_id) == before
    ok = post(gateway, key, {"model": "vision", "messages": two_parts(images.url("/cat.png"))})
    assert ok.status_code == 200, ok.text
    assert counters(store, tenant_id) != before  # an admitted request does move them


def test_the_image_price_settles_spend_and_budget_and_is_reserved(
    gateway: GatewayProcess, store: RedisServer, images: MediaServer
) -> None:
    tenant_id, _ = gateway.create_tenant()
    key_id, key = new_key(gateway, tenant_id, budget_usd=10, budget_period="daily")
    data_url = "data:image/png;base64," + base64.b64encode(images.image).decode()
    parts = [
        *two_parts(data_url)[0]["content"],
        {"type": "image_url", "image_url": {"url": images.url("/cat.png")}},
    ]  # type: ignore[list-item]
    reply = oa(gateway, key).chat.completions.create(
        model="vision",
        messages=[{"role": "user", "content": parts}],
        max_tokens=3,
        temperature=0,  # type: ignore[list-item,misc]
    )
    usage = reply.usage
    assert usage is not None
    # micro-dollars: 1 a prompt token (cached ones too), 2 an output token, 1000 an image
    expected = usage.prompt_tokens + 2 * usage.completion_tokens + 2 * 1000
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert wait_until(lambda: spend_key(store, tenant_id, f"k:{key_id}", f"d:{day}") > 0, 30)
    assert spend_key(store, tenant_id, f"k:{key_id}", f"d:{day}") == expected
    assert counted(gateway, tenant_id, 1)["keys"][key_id]["spend_micro_usd"] == expected

    # a budget that pays for this prompt's tokens and one output token, but not its two images
    # (it would be admitted if images were free): refused before anything is forwarded
    short = (usage.prompt_tokens + 2 + 1500) / 1e6
    short_id, short_key = new_key(gateway, tenant_id, budget_usd=short, budget_period="daily")
    before = images.hits["/cat.png"]
    with pytest.raises(openai.RateLimitError) as info:
        oa(gateway, short_key).chat.completions.create(
            model="vision",
            messages=[{"role": "user", "content": parts}],
            max_tokens=3,  # type: ignore[list-item,misc]
        )
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "budget_exceeded", error
    assert images.hits["/cat.png"] == before + 1  # fetched (before admission), never forwarded
    assert spend_key(store, tenant_id, f"k:{short_id}", f"d:{day}") == 0
