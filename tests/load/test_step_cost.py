"""``load/step_cost.py`` on the tiny Llama: every size is measured in every round, and a bad
flag is a usage error. Times are only checked to be positive (a benchmark, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.step_cost import main, measure


def test_every_size_is_measured_each_round(tiny_llama_dir: Path, tmp_path: Path) -> None:
    times = measure(str(tiny_llama_dir), decodes=3, sizes=[0, 8, 32], reps=2)
    assert sorted(times) == [0, 8, 32]
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())
    out = tmp_path / "cost.json"
    assert main(["--model", str(tiny_llama_dir), "--decodes", "2", "--sizes", "0,8",
                 "--reps", "1", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["prefill_tokens"] for r in rows] == [0, 8]
    assert rows[0]["ms_per_prefill_token"] is None and rows[1]["least_ms"] > 0


@pytest.mark.parametrize("flags", [["--sizes", "-1,8"], ["--reps", "0"], ["--decodes", "-2"]])
def test_bad_flags_are_usage_errors(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 2
