"""``portico bench batch``: its batch file is one the gateway accepts line by line, and a quick
real run (a real ``portico serve`` with the tiny Llama) reports every part with the batch
finished. No timing is asserted: the numbers are the benchmark's business, not the test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.batch.batches import BatchLine, batch_model, parse_line, read_lines
from load.batch_bench import CHAT, SERVED_NAME, batch_file, has_content, main


def test_every_line_of_the_batch_file_is_well_formed() -> None:
    lines = read_lines(batch_file(5, 4))
    assert len(lines) == 5 and batch_model(lines) == SERVED_NAME
    parsed = [parse_line(i, raw, CHAT, SERVED_NAME) for i, raw in enumerate(lines)]
    assert all(isinstance(line, BatchLine) for line in parsed)
    assert len({line.custom_id for line in parsed}) == 5


@pytest.mark.slow
def test_quick_run_reports_both_phases_and_a_finished_batch(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "batch.json"
    engine_args = "--kv-cache-memory 32MiB --max-num-seqs 32 --max-model-len 1024"
    argv = ["--quick", "--model", str(tiny_llama_dir), "--engine-args", engine_args]
    assert main([*argv, "--max-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["batch"]["status"] == "completed"
    assert report["batch"]["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    for side in ("ttft_alone", "ttft_with_batch"):
        assert report[side]["median"] > 0
    assert {"ratio_p50", "ratio_p99", "target_met_p50", "load_average"} <= set(report)


def test_the_role_chunk_is_not_a_first_token() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "Apple"}}]}
    assert not has_content("data: " + json.dumps(role))
    assert has_content("data: " + json.dumps(token))
    assert not has_content("data: [DONE]") and not has_content(": keep-alive")
    assert not has_content("data: " + json.dumps({"choices": [], "usage": {"total_tokens": 3}}))
