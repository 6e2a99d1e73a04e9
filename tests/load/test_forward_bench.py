"""``python -m load.forward_bench``: the forward-only decode benchmark runs end to end."""

from __future__ import annotations

import subprocess
import sys


def test_forward_bench_reports_tokens_per_second_for_each_batch_size(tiny_llama_dir) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "load.forward_bench", "--model", str(tiny_llama_dir),
         "--batch-sizes", "1,3", "--context-len", "8", "--steps", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "tok/s" in line]
    assert [line.split("batch=")[1].split()[0] for line in lines] == ["1", "3"]
    assert all(float(line.split(": ")[-1].split()[0]) > 0 for line in lines)
