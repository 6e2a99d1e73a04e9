"""The fake upstream must look like an OpenAI server to the real client: benchmarks and the
gateway's tests depend on it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "load.fake_upstream", "--port", str(port), "--chunks", "5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert "listening" in proc.stdout.readline()
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    assert proc.wait(timeout=10) == 0


def test_chat_completion_with_usage(fake_url: str) -> None:
    client = OpenAI(base_url=f"{fake_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.choices[0].message.content == " tok tok tok"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_streaming_chat_ends_with_usage_then_done(fake_url: str) -> None:
    client = OpenAI(base_url=f"{fake_url}/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_completions_and_models(fake_url: str) -> None:
    client = OpenAI(base_url=f"{fake_url}/v1", api_key="unused")
    assert client.completions.create(model="m", prompt="x", max_tokens=2).choices[0].text == (
        " tok tok"
    )
    assert [m.id for m in client.models.list()] == ["fake-model"]


def test_fake_status_and_chunk_delay(fake_url: str) -> None:
    with httpx.Client(base_url=fake_url) as http:
        bad = http.post("/v1/chat/completions", json={"fake_status": 503, "messages": []})
        assert bad.status_code == 503
        assert bad.json()["error"]["message"]
        start = time.perf_counter()
        with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 3, "stream": True, "fake_chunk_delay_ms": 50},
        ) as resp:
            lines = [line for line in resp.iter_lines() if line]
        # three delays of 50 ms happened (a lower bound, never an upper one)
        assert time.perf_counter() - start >= 0.15
        assert lines[-1] == "data: [DONE]"
        assert http.get("/nope").status_code == 404
