"""The admission benchmark runs against a real Redis and writes its JSON (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from load.admission_bench import main


def test_bench_writes_percentiles_for_admit_and_settle(redis_url: str, tmp_path: Path) -> None:
    out = tmp_path / "admission.json"
    client = redis.Redis.from_url(redis_url)
    try:
        client.set("someone:else", "1")
        argv = ["--redis-url", redis_url, "--requests", "40", "--concurrency", "4"]
        assert main([*argv, "--out", str(out)]) == 0
        # it cleans up after itself, and only its own keys: --redis-url may be a Redis in use
        assert client.keys("*") == [b"someone:else"]
    finally:
        client.close()
    result = json.loads(out.read_text())
    for section in ("sequential", "local_limiter_sequential"):
        for op in ("admit", "settle_and_release"):
            stats = result[section][op]
            assert stats["samples"] == 40
            assert 0 < stats["p50_us"] <= stats["p99_us"]
    assert result["concurrent"]["admit_latency"]["samples"] == 40
    assert result["concurrent"]["requests_per_second"] > 0
    assert result["redis_evalsha_usec_per_call"] > 0
