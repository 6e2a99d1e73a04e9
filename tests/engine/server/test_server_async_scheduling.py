"""`portico engine --async-scheduling` through the real `openai` client: the same greedy and
seeded replies as the synchronous engine process (the session's ``engine_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from engine_server_process import MODEL_NAME, EngineProcess

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 3
USER = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def async_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("engine-async-logs")
    server = EngineProcess(tiny_llama_dir, logs / "engine.log", extra=["--async-scheduling"])
    try:
        server.wait_ready()
        yield server
    finally:
        code = server.stop()
        assert code == 0, server.logs()


def client_of(server: EngineProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


def replies(client: openai.OpenAI) -> list[object]:
    """A greedy completion, a seeded n=2 completion with a stop string, a streamed chat."""
    greedy = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seeded = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = greedy.choices[0].text
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.0,
        stop=[text[5:8]], extra_body={"ignore_eos": True},
    )  # fmt: skip
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=8, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return [
        (text, greedy.choices[0].finish_reason, greedy.usage.completion_tokens),
        sorted((c.index, c.text) for c in seeded.choices),
        (stopped.choices[0].text, stopped.choices[0].finish_reason),
        streamed,
    ]


@pytest.mark.slow  # its own engine process: tens of seconds to start on a busy 2-core machine
def test_async_engine_process_answers_as_the_synchronous_one(
    async_server: EngineProcess, engine_server: EngineProcess
) -> None:
    got = replies(client_of(async_server))
    assert got == replies(client_of(engine_server))
    assert got[0][1:] == ("length", 12)
    assert got[2][1] == "stop" and len(got[2][0]) < len(got[0][0])
    assert len(got[3]) > 0
