"""The serving benchmark's workloads, arrival times and metrics math, and a short real run
against the fake upstream."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from load import datasets, serve_bench
from load.serve_bench import RequestResult


def test_synthetic_is_deterministic_and_in_range() -> None:
    a = datasets.synthetic(50, (16, 600), (16, 256), seed=3)
    b = datasets.synthetic(50, (16, 600), (16, 256), seed=3)
    assert a == b
    assert a != datasets.synthetic(50, (16, 600), (16, 256), seed=4)
    for r in a:
        assert 16 <= r.prompt_len <= 600 and len(r.prompt) == r.prompt_len
        assert 16 <= r.output_len <= 256


def test_shared_prefix_groups_share_exactly_the_prefix() -> None:
    reqs = datasets.shared_prefix(num_groups=3, requests_per_group=4, prefix_len=64, suffix_len=8)
    assert len(reqs) == 12
    prefixes = {tuple(r.prompt[:64]) for r in reqs}
    assert len(prefixes) == 3
    assert len({tuple(r.prompt) for r in reqs}) == 12


def test_sharegpt_reads_conversations(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "x" * 40},
                        {"from": "gpt", "value": "y" * 80},
                    ]
                },
                {"conversations": [{"from": "human", "value": "only one turn"}]},
            ]
        )
    )
    reqs = datasets.sharegpt(path, 10)
    assert len(reqs) == 1
    assert reqs[0].prompt_len == 10 and reqs[0].output_len == 20
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no conversations"):
        datasets.sharegpt(empty, 1)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrival_gaps_have_the_requested_mean(burstiness: float) -> None:
    gaps = datasets.arrival_gaps(20000, request_rate=50.0, burstiness=burstiness, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    # burstier arrivals spread wider: the coefficient of variation is 1/sqrt(burstiness)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(burstiness**-0.5, rel=0.1)
    with pytest.raises(ValueError, match="request_rate"):
        datasets.arrival_gaps(1, 0.0)


def test_metrics_math_on_hand_made_timings() -> None:
    results = [
        RequestResult(
            ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]
        ),
        RequestResult(ok=True, prompt_len=20, output_tokens=1, ttft=0.3, latency=0.3),
        RequestResult(ok=False, prompt_len=5, error="HTTP 429"),
    ]
    assert results[0].tpot == pytest.approx(0.1)
    assert results[1].tpot == 0.0
    s = serve_bench.summarize(results, duration=2.0, ttft_slo_ms=200)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 429"]
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(18.0)
    assert s["goodput"] == pytest.approx(0.5)  # only the first meets the 200 ms TTFT target
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(300.0)
    assert s["tpot_ms"]["median"] == pytest.approx(100.0)


@pytest.fixture(scope="module")
def fake_base_url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "load.fake_upstream", "--port", str(port), "--chunk-delay-ms", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and "listening" in proc.stdout.readline()
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    proc.wait(timeout=10)


def test_short_run_against_fake_upstream_writes_json_and_plot(
    fake_base_url: str, tmp_path: Path
) -> None:
    reqs = datasets.synthetic(12, (4, 8), (3, 6), seed=0)
    summary, results = asyncio.run(
        serve_bench.run_benchmark(
            fake_base_url, "fake-model", reqs, request_rate=200.0, max_concurrency=4, progress=False
        )
    )
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(r.output_len for r in reqs)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[key]
        assert 0 < p["median"] <= p["p90"] <= p["p99"]
    out = tmp_path / "serve.json"
    serve_bench.write_results(out, summary, results)
    assert len(json.loads(out.read_text())["requests"]) == 12
    from load.report import plot_latency_cdfs

    png = plot_latency_cdfs({"fake": results}, tmp_path / "cdf.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failures_are_counted_not_hidden(fake_base_url: str) -> None:
    reqs = datasets.synthetic(3, (4, 4), (2, 2), seed=0)
    summary, _ = asyncio.run(
        serve_bench.run_benchmark(
            fake_base_url, "m", reqs, extra_body={"fake_status": 503}, progress=False
        )
    )
    assert summary["failed"] == 3 and "HTTP 503" in summary["errors"][0]


def test_random_images_are_deterministic_pngs_of_the_asked_sizes() -> None:
    import base64
    import io

    from PIL import Image

    a = datasets.random_images(6, images_per_request=2, image_size=(40, 90), seed=5)
    assert a == datasets.random_images(6, images_per_request=2, image_size=(40, 90), seed=5)
    assert a != datasets.random_images(6, images_per_request=2, image_size=(40, 90), seed=6)
    sizes = set()
    for req in a:
        assert len(req.images) == 2 and isinstance(req.prompt, str)
        assert req.prompt.startswith("Describe this picture.")
        for url in req.images:
            head, _, payload = url.partition(",")
            assert head == "data:image/png;base64"
            with Image.open(io.BytesIO(base64.b64decode(payload))) as picture:
                assert picture.format == "PNG"
                assert 40 <= picture.width <= 90 and 40 <= picture.height <= 90
                sizes.add(picture.size)
    assert len(sizes) > 1  # sizes are drawn, not fixed
    # no pictures: the same texts and output lengths, the text-only baseline of the workload
    bare = datasets.random_images(6, images_per_request=0, image_size=(40, 90), seed=5)
    assert [(r.prompt, r.output_len) for r in bare] == [(r.prompt, r.output_len) for r in a]
    assert all(r.images == () for r in bare)
    with pytest.raises(ValueError, match="images_per_request"):
        datasets.random_images(1, images_per_request=-1)
    with pytest.raises(ValueError, match="image_size"):
        datasets.random_images(1, image_size=(90, 40))


def test_image_requests_go_to_chat_completions(fake_base_url: str) -> None:
    reqs = datasets.random_images(4, image_size=(16, 24), prompt_len=(3, 5), output_len=(3, 5))
    summary, results = asyncio.run(
        serve_bench.run_benchmark(fake_base_url, "m", reqs, max_concurrency=2, progress=False)
    )
    assert summary["completed"] == 4 and summary["failed"] == 0
    # the fake answers a chat stream (delta.content) with exactly max_tokens tokens
    assert [r.output_tokens for r in results] == [r.output_len for r in reqs]
    assert all(r.ttft > 0 for r in results)


def test_bench_cli_refuses_a_bad_image_workload(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "portico.cli", "bench", "serve", "--base-url",
         "http://127.0.0.1:9/v1", "--model", "m", "--dataset", "random-image",
         "--image-size", "300", "20", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "image_size must be 1 <= MIN <= MAX" in proc.stderr
    assert not (tmp_path / "x.json").exists()
