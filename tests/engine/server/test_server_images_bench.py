"""`portico bench serve`'s image workload against a real `portico engine` serving a tiny random
LLaVA: every request completes with the asked output length, the usage it reports counts the
image tokens (the same texts without pictures count exactly the image's tokens fewer), and
requests the engine refuses are counted as failures with the engine's message."""

from __future__ import annotations

import asyncio

import pytest
from engine_server_process import MODEL_NAME, EngineProcess

from load import datasets, serve_bench

pytestmark = pytest.mark.slow

IMAGE_TOKENS = 16  # tests/tiny_llava.py: (32 / 8)^2 patches per picture, whatever its size


def bench(server: EngineProcess, reqs: list[datasets.BenchRequest]) -> tuple[dict, list]:
    return asyncio.run(
        serve_bench.run_benchmark(
            server.base_url + "/v1", MODEL_NAME, reqs, max_concurrency=3,
            api_key=server.api_key, extra_body={"ignore_eos": True}, progress=False,
        )
    )  # fmt: skip


def test_image_workload_counts_image_tokens(llava_server: EngineProcess) -> None:
    shape = {"image_size": (20, 70), "prompt_len": (3, 9), "output_len": (2, 6), "seed": 3}
    with_images = datasets.random_images(6, images_per_request=2, **shape)  # type: ignore[arg-type]
    bare = datasets.random_images(6, images_per_request=0, **shape)  # type: ignore[arg-type]
    summary, results = bench(llava_server, with_images)
    assert summary["completed"] == 6 and summary["failed"] == 0, summary["errors"]
    assert [r.output_tokens for r in results] == [r.output_len for r in with_images]
    base_summary, base = bench(llava_server, bare)
    assert base_summary["failed"] == 0, base_summary["errors"]
    # prompt_len is the engine's usage.prompt_tokens: two pictures add their 16 tokens each and
    # the template's "<image>\n" line per picture, the same for every request
    extra = {r.prompt_len - b.prompt_len for r, b in zip(results, base, strict=True)}
    assert len(extra) == 1 and extra.pop() >= 2 * IMAGE_TOKENS
    assert summary["total_prompt_tokens"] > base_summary["total_prompt_tokens"]


def test_refused_image_requests_are_failures_with_the_reason(llava_server: EngineProcess) -> None:
    reqs = datasets.random_images(2, images_per_request=3, image_size=(20, 30), output_len=(2, 2))
    summary, results = bench(llava_server, reqs)
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert all(r.error.startswith("HTTP 400") for r in results)
    assert "messages" in summary["errors"][0]
