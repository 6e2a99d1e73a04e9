"""load/remote_bench.py: the verdicts and the table from a result (the run itself is a bench)."""

from __future__ import annotations

from load.remote_bench import TIERS, parse_args, table, verdicts


def _sat(rps: float, per_cpu: float) -> dict[str, float]:
    return {"requests_per_s": rps, "requests_per_cpu_second": per_cpu}


def test_verdicts_compare_remote_with_engine() -> None:
    result = {
        "saturation": {
            "engine_json": _sat(1000, 3000),
            "remote_json": _sat(790, 2900),
            "engine_stream": _sat(900, 2800),
            "remote_stream": _sat(900, 2800),
        },
        "paired": {
            "remote_minus_engine_ms": {
                "json": {"median": 0.1, "p90": 0.0, "p99": 0.0},
                "stream": {"median": 0.5, "p90": 0.0, "p99": 0.0},
            },
            "remote_minus_engine_tcp_ms": {
                "json": {"median": 0.0, "p90": 0.0, "p99": 0.0},
                "stream": {"median": 0.0, "p90": 0.0, "p99": 0.0},
            },
        },
    }
    met = {v["target"]: v["met"] for v in verdicts(result)}
    assert met["remote req/s >= 80% of engine (json)"] is False  # 79 %
    assert met["remote req/CPU-s >= 80% of engine (json)"] is True
    assert met["remote req/s >= 80% of engine (stream)"] is True
    assert met["remote added p50 within 0.3 ms of engine (json)"] is True
    assert met["remote added p50 within 0.3 ms of engine (stream)"] is False
    assert met["remote added p50 within 0.3 ms of engine_tcp (stream)"] is True
    rows = table(result).splitlines()
    assert len(rows) == 2 + len(TIERS) and rows[4].startswith("| remote | 790 | 900 |")


def test_defaults_run_every_phase() -> None:
    args = parse_args([])
    assert args.phases == ["fixed", "paired", "saturation"] and args.paired_rate == 100.0
