"""The salting/accounting cost script runs the old and the new request path on the same
inputs; the TTFT side-channel script's statistics are right."""

from __future__ import annotations

import pytest

from load import accounting_cost
from load.cache_timing import mann_whitney_p


def test_the_cost_script_compares_before_and_now(capsys: pytest.CaptureFixture[str]) -> None:
    assert accounting_cost.main(["--number", "5", "--repeat", "1", "--chunks", "4"]) == 0
    out = capsys.readouterr().out
    assert "| relay usage of a 4-token stream |" in out
    assert out.count("\n| ") == 5  # header + 4 rows


def test_mann_whitney_tells_shifted_samples_apart_and_equal_ones_not() -> None:
    a = [float(x) for x in range(20)]
    assert mann_whitney_p(a, [x + 100 for x in a]) < 1e-6
    assert mann_whitney_p(a, list(reversed(a))) == pytest.approx(1.0)
    assert 0.0 < mann_whitney_p(a, [x + 3 for x in a]) < 1.0
