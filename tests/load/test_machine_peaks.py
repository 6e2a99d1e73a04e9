"""load/machine_peaks.py measures what it names (no threshold on the figures: they depend on
the machine and its load)."""

from __future__ import annotations

import json
from pathlib import Path

from load import machine_peaks
from load.machine_peaks import best_seconds, stream_bandwidth


def test_best_seconds_times_every_repeat_and_keeps_the_fastest() -> None:
    calls = []
    best, times = best_seconds(lambda: calls.append(1), 4)
    assert len(calls) == 5  # one warm-up
    assert len(times) == 4 and best == min(times)


def test_stream_kernels_report_bandwidth_for_each_kernel() -> None:
    out = stream_bandwidth(megabytes=2, repeats=2)
    assert set(out) == {"read_gb_s", "copy_gb_s", "triad_gb_s"}
    assert all(v > 0 for v in out.values())


def test_report_names_every_peak(tmp_path: Path) -> None:
    path = tmp_path / "peaks.json"
    assert machine_peaks.main(["--megabytes", "2", "--repeats", "1", "--output", str(path)]) == 0
    report = json.loads(path.read_text())
    assert {"threads", "read_gb_s", "triad_gb_s", "torch_int_mm_gops", "fp32_gflops"} <= set(report)
