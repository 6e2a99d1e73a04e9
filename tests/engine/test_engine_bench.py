"""The offline benchmark runs end to end and writes its JSON (a smoke test: no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from load import engine_bench


@pytest.mark.parametrize("flags", [[], ["--async-scheduling"]])
def test_engine_bench_writes_both_systems_results(
    tiny_llama_dir: Path, tmp_path: Path, flags: list[str]
) -> None:
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        code = engine_bench.main([
            "--model", str(tiny_llama_dir), "--device", "cpu", "--threads", "1",
            "--num-requests", "3", "--min-prompt", "4", "--max-prompt", "20",
            "--min-output", "2", "--max-output", "6", "--single-stream-tokens", "4",
            "--hf-batch-size", "2", "--output", str(out), *flags,
        ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(out.read_text())
    work = result["workload"]
    assert work["num_requests"] == 3 and 6 <= work["num_output_tokens"] <= 18
    for system in ("portico", "transformers"):
        assert result[system]["output_tokens_per_s"] > 0
    assert result["single_stream"]["output_tokens"] == 4
    assert result["speedup"] > 0
    assert result["engine_config"]["async_scheduling"] == bool(flags)
    assert set(result["targets"]) == {"speedup_at_least_3x", "single_stream_at_least_50_tok_s"}
