"""``portico engine --allowed-media-domains``: a real engine serving a tiny random LLaVA
fetches allowed image URLs from a real local HTTP server and answers exactly as for the same
image sent as a data URL; a refused URL is a 400 naming the part with nothing queued."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from engine_server_process import MODEL_NAME, EngineProcess, metric

from tests.media_server import MediaServer, png

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def images() -> Iterator[MediaServer]:
    server = MediaServer(png(11))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(
    tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("llava-url-logs")
    flags = ["--allowed-media-domains", "localhost", "--allowed-media-networks", "127.0.0.0/8",
             "::1/128", "--max-media-bytes", "65536", "--media-fetch-timeout-s", "2"]  # fmt: skip
    engine = EngineProcess(tiny_llava_dir, logs / "engine.log", extra=flags)
    try:
        engine.wait_ready()
        yield engine
    finally:
        assert engine.stop() == 0, engine.logs()


def ask(url: str) -> list[dict[str, Any]]:
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return [{"role": "user", "content": parts}]


def test_an_allowed_url_answers_as_the_same_data_url(
    server: EngineProcess, images: MediaServer
) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)
    data_url = "data:image/png;base64," + base64.b64encode(images.image).decode()
    replies = [
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=ask(url),
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        for url in (data_url, images.url("/to-cat"))
    ]
    assert images.hits["/cat.png"] == 1
    assert replies[1].choices[0].message.content == replies[0].choices[0].message.content
    assert replies[0].usage is not None and replies[1].usage is not None
    assert replies[1].usage.prompt_tokens == replies[0].usage.prompt_tokens


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:{port}/cat.png", "not an allowed media domain"),
        ("http://localhost:{port}/away", "not an allowed media domain"),
        ("http://localhost:{port}/big.png", "larger than 65536 bytes"),
        ("http://localhost:{port}/page", "not a PNG"),
    ],
)
def test_a_refused_url_is_a_400_naming_the_part(
    server: EngineProcess, images: MediaServer, url: str, words: str
) -> None:
    with server.client() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": ask(url.format(port=images.port))},
        )
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url.url" and words in error["message"]
    after = server.metrics()
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
