"""``python -m load.standard``: the report writer turns given results into the markdown tables
with met / not met per target, failures are recorded rather than raised, and one real section
runs end to end into a report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from load import standard
from load.standard_report import engine_speedup, render_report, targets


def _served_summary(ttft_p50: float) -> dict[str, Any]:
    pct = {"mean": ttft_p50, "median": ttft_p50, "p90": ttft_p50 * 1.5, "p99": ttft_p50 * 2}
    return {
        "completed": 8,
        "failed": 0,
        "output_throughput": 123.4,
        "request_throughput": 1.5,
        "ttft_ms": pct,
        "tpot_ms": pct,
        "e2e_ms": pct,
        "itl_ms": pct,
    }


def _gateway_result() -> dict[str, Any]:
    side = {
        "json": {"mean": 1.0, "median": 0.9, "p90": 1.5, "p99": 3.0, "count": 200.0},
        "stream": {"mean": 1.2, "median": 1.1, "p90": 1.7, "p99": 4.0, "count": 200.0},
        "errors": 0,
        "error_examples": [],
        "send_lag_p99_ms": 0.5,
    }
    return {
        "config": {
            "gateway_cpus": "0",
            "client_cpus": "1",
            "tenants": 8,
            "keys_per_tenant": 4,
            "models": ["fake-a", "fake-b"],
            "rounds": 3,
            "duration_s": 15.0,
            "wrk_connections": 64,
            "auth": "api keys",
            "limits": "all",
        },
        "fixed_rate": [
            {
                "rate": 200.0,
                "requests_per_side": 9000,
                "rounds": 3,
                "direct": side,
                "gateway": side | {"cpu_ms_per_request": 2.5},
                "overhead": {
                    "json": {"median_ms": 0.8, "p90_ms": 1.0, "p99_ms": 2.0},
                    "stream": {"median_ms": 1.7, "p90_ms": 2.0, "p99_ms": 9.5},
                },
                "gateway_reported_overhead_ms": {"median": 0.7, "p99": 1.9},
            }
        ],
        "saturation": _gateway_saturation_result(),
        "rate_limits": _gateway_rate_limits_result(),
        "verdicts": [
            {
                "target": "added p50 latency (json) <= 1 ms at 200 req/s",
                "measured": "0.80 ms",
                "met": True,
            },
            {
                "target": "gateway >= 1500 req/s on one core (json)",
                "measured": "1234 req/s",
                "met": False,
            },
        ],
        "plots": ["/repo/docs/img/gateway_latency_cdf.png"],
    }


def _gateway_saturation_result() -> dict[str, Any]:
    return {
        "tool": "wrk",
        "duration_s": 15.0,
        "direct_json": {"requests_per_s": 27000.0, "p50_ms": 2.0, "p99_ms": 9.0, "non2xx": 0},
        "gateway_json": {
            "requests_per_s": 1234.5,
            "p50_ms": 40.0,
            "p99_ms": 90.0,
            "non2xx": 0,
            "cpu_ms_per_request": 0.8,
            "core_share": 0.99,
            "requests_per_cpu_second": 1250.0,
        },
        "gateway_stream": {"error": "wrk failed (1): boom"},
        "python_generator_ceiling_rps": 4321.0,
    }


def _gateway_rate_limits_result() -> dict[str, Any]:
    return {
        "background_rate": 200.0,
        "background_requests": 3000,
        "background_errors": 0,
        "ok": True,
        "tenants": [
            {
                "tenant": "limited30-0",
                "requests_per_minute": 30,
                "sent": 100,
                "admitted": 31,
                "limited_429": 69,
                "other": 0,
                "elapsed_s": 3.2,
                "expected_min": 30,
                "expected_max": 31.6,
                "ok": True,
            }
        ],
    }


def _results() -> dict[str, Any]:
    return {
        "machine": {
            "cpu": "Test CPU",
            "cpu_count": 2,
            "python": "3.12",
            "torch": "2.13",
            "commit": "abc1234",
            "platform": "Linux",
        },
        "started": "2026-11-29 13:30 UTC",
        "mode": "quick",
        "sections": {
            "engine_offline": {
                "status": "ok",
                "command": "python -m load.engine_bench --quick",
                "result": {
                    "concurrency_64": {"engine_tok_s": 900.0, "static_tok_s": 250.0, "speedup": 3.6}
                },
            },
            "engine_served": {
                "status": "ok",
                "command": "portico engine ...",
                "result": {
                    "runs": [{"concurrency": c} | _served_summary(10.0 * c) for c in (1, 16, 64)],
                    "workload": {"prompt_len": [16, 128], "output_len": [16, 32], "seed": 0},
                    "plots": ["/repo/docs/img/engine_served_cdf.png"],
                },
            },
            "prefix_caching": {
                "status": "ok",
                "command": "portico engine ...",
                "result": {
                    "on": _served_summary(50.0),
                    "off": _served_summary(200.0),
                    "ttft_p50_ratio": 4.0,
                    "workload": {"groups": 4},
                },
            },
            "gateway": {
                "status": "ok",
                "command": "python -m load.gateway_bench --quick",
                "result": _gateway_result(),
            },
            "admission": {
                "status": "failed",
                "command": "python -m load.admission_bench",
                "error": "RuntimeError: redis-server did not start",
            },
        },
    }


def test_report_has_a_table_per_section_and_each_target_verdict() -> None:
    text = render_report(_results(), Path("/repo/docs"))
    assert text.startswith("# Benchmarks")
    assert "| target | measured | verdict |" in text
    assert "3.60x (`concurrency_64.speedup`) | **met**" in text
    assert "4.00x | **met**" in text  # prefix caching 200 / 50
    assert "added p50 latency (json) <= 1 ms at 200 req/s | 0.80 ms | **met**" in text
    assert "1234 req/s | **not met**" in text
    # served engine: one row per concurrency with the TTFT/TPOT percentiles
    assert "| concurrency | requests | failed | output tok/s |" in text
    assert "| 64 | 8 | 0 | 123.4 |" in text
    # gateway: side by side, overhead rows, saturation with the failed run named, limits
    assert "| gateway - direct (stream) | 1.70 | 2.00 | 9.50 |" in text
    assert "failed: wrk failed (1): boom" in text
    assert "| 30 | 100 | 31 | 69 | 0 | 3.20 | 30..31.6 | yes |" in text
    assert "4321 requests/s" in text
    # the failed section says so, with its error and its command, and invents nothing
    assert "**This section failed**" in text and "redis-server did not start" in text
    assert "python -m load.admission_bench" in text
    # plots as relative links
    assert "![gateway_latency_cdf](img/gateway_latency_cdf.png)" in text
    assert "![engine_served_cdf](img/engine_served_cdf.png)" in text


def test_targets_not_measured_when_sections_failed_or_are_missing() -> None:
    results = _results()
    results["sections"]["engine_offline"] = {
        "status": "skipped",
        "error": "load/engine_bench.py is not in the tree",
    }
    del results["sections"]["gateway"]
    rows = {r["target"][:20]: r for r in targets(results["sections"])}
    engine = next(r for r in rows.values() if r["target"].startswith("engine >="))
    assert engine["verdict"] == "not measured" and "not in the tree" in engine["measured"]
    gateway = next(r for r in rows.values() if r["target"].startswith("gateway adds"))
    assert gateway["verdict"] == "not measured" and gateway["measured"] == "section not run"
    text = render_report(results)
    assert "**Skipped**: load/engine_bench.py is not in the tree" in text
    assert "Gateway vs calling" not in text


def test_engine_speedup_prefers_concurrency_64() -> None:
    assert engine_speedup({"c16": {"speedup": 2.0}, "c64": {"speedup": 3.5}}) == (
        3.5,
        "c64.speedup",
    )
    assert engine_speedup({"runs": [{"speedup_vs_static": 1.5}]})[0] == 1.5
    assert engine_speedup({"throughput": 10.0}) == (None, "engine_bench reported no speedup field")


def test_a_failing_section_is_recorded_and_does_not_raise() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("engine exploded")

    def skipped() -> dict[str, Any]:
        raise standard.SectionSkipped("no wrk here")

    failed = standard.run_section("x", "cmd", broken)
    assert failed["status"] == "failed" and "engine exploded" in failed["error"]
    assert "result" not in failed and failed["command"] == "cmd"
    assert standard.run_section("y", "cmd", skipped) | {
        "seconds": 0,
        "load_average": [],
        "finished": "t",
    } == {
        "command": "cmd",
        "status": "skipped",
        "error": "no wrk here",
        "seconds": 0,
        "finished": "t",
        "load_average": [],
    }
    assert standard.run_section("z", "cmd", lambda: {"a": 1})["result"] == {"a": 1}


def test_commands_reproduce_each_section() -> None:
    commands = standard.section_commands(True, standard.QUICK)
    assert set(commands) == set(standard.SECTIONS)
    assert "portico engine --model smollm2-135m" in commands["engine_served"]
    assert "--dtype bfloat16" in commands["engine_served"]
    assert "--max-concurrency 64" in commands["engine_served"]
    assert commands["gateway"].startswith("python -m load.gateway_bench --quick")


def test_one_real_section_into_a_report_keeping_earlier_results(tmp_path: Path) -> None:
    results_path = tmp_path / "results.json"
    earlier = _results()
    results_path.write_text(json.dumps(earlier))
    report = tmp_path / "benchmarks.md"
    assert (
        standard.main(
            [
                "--quick",
                "--only",
                "admission",
                "--results",
                str(results_path),
                "--report",
                str(report),
                "--img-dir",
                str(tmp_path / "img"),
            ]
        )
        == 0
    )
    saved = json.loads(results_path.read_text())
    assert saved["sections"]["admission"]["status"] == "ok", saved["sections"]["admission"]
    assert saved["sections"]["admission"]["result"]["sequential"]["admit"]["samples"] == 1000
    assert saved["sections"]["gateway"] == earlier["sections"]["gateway"]
    text = report.read_text()
    assert "| admit, one at a time (Redis Lua, all limits on) |" in text
    assert "**This section failed**" not in text


def test_engine_bench_results_render_side_by_side() -> None:
    results = _results()
    results["sections"]["engine_offline"]["result"] = {
        "device": "cpu",
        "dtype": "bfloat16",
        "threads": 2,
        "workload": {
            "num_requests": 64,
            "prompt_len": [16, 128],
            "output_len": [16, 64],
            "num_output_tokens": 2500,
            "seed": 0,
        },
        "portico": {"elapsed_s": 50.0, "output_tokens_per_s": 50.0, "total_tokens_per_s": 140.0},
        "transformers": {
            "elapsed_s": 125.0,
            "output_tokens_per_s": 20.0,
            "total_tokens_per_s": 56.0,
        },
        "speedup": 2.5,
        "single_stream": {"decode_tokens_per_s": 9.5, "ttft_s": 0.2},
        "targets": {"speedup_at_least_3x": False},
    }
    text = render_report(results)
    assert "| portico engine (continuous batching, paged KV) | 50.00 | 50.00 | 140.0 |" in text
    assert "| transformers generate, static batches | 125.0 | 20.00 | 56.00 |" in text
    assert "Speedup (output tokens/s): **2.5x**" in text
    assert "2.50x (`speedup`) | **not met**" in text
    assert "9.5 tok/s | **not met**" in text  # single stream, against 50 tok/s
    results["sections"]["engine_offline"]["result"]["single_stream"]["decode_tokens_per_s"] = 61.0
    assert "61.0 tok/s | **met**" in render_report(results)
    command = standard.section_commands(True, standard.QUICK)["engine_offline"]
    assert "--dtype bfloat16" in command and command.startswith("GOMP_SPINCOUNT=30000 ")


def test_a_child_benchmark_that_fails_or_hangs_becomes_an_error_with_its_output() -> None:
    import pytest

    with pytest.raises(RuntimeError, match="exited 2:(.|\n)*unrecognized arguments: --bogus"):
        standard.run_json_module("load.admission_bench", ["--bogus"], 120)
    with pytest.raises(RuntimeError, match="did not finish in 3 s(.|\n)*listening"):
        standard.run_json_module("load.fake_upstream", ["--port", "0"], 3, out_flag="--model")


def test_portico_bench_delegates_to_gateway_and_standard() -> None:
    import subprocess
    import sys

    for name, flag in (("gateway", "--rates"), ("standard", "--only")):
        out = subprocess.run(
            [sys.executable, "-m", "portico.cli", "bench", name, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert flag in out.stdout and "--quick" in out.stdout


def test_failed_gateway_requests_are_named_not_hidden() -> None:
    results = _results()
    run = results["sections"]["gateway"]["result"]["fixed_rate"][0]
    run["gateway"] = run["gateway"] | {"errors": 2, "error_examples": ["HTTP 503"]}
    text = render_report(results)
    assert "Failed requests (not in the percentiles): gateway: 2 failed (HTTP 503)." in text
    assert "Failed requests" not in render_report(_results())


def test_a_new_report_keeps_the_hand_written_sections_below_the_marker() -> None:
    from load.standard_report import HAND_WRITTEN_MARKER, keep_hand_written

    generated = render_report(_results(), Path("/repo/docs"))
    old = (
        "# Benchmarks\n\nold numbers\n\n" + HAND_WRITTEN_MARKER + "\n\n## Fairness\n\nQ p99 1.5 s\n"
    )
    merged = keep_hand_written(generated, old)
    assert merged.startswith(generated.rstrip("\n"))
    assert "old numbers" not in merged  # the generated part is replaced
    assert merged.endswith(HAND_WRITTEN_MARKER + "\n\n## Fairness\n\nQ p99 1.5 s\n")
    assert keep_hand_written(generated, None) == generated
    assert keep_hand_written(generated, "# no marker in it\n") == generated


def test_the_checked_in_report_has_the_marker() -> None:
    from load.standard_report import HAND_WRITTEN_MARKER

    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert page.count(HAND_WRITTEN_MARKER) == 1
    assert page.index("## How these numbers are taken") < page.index(HAND_WRITTEN_MARKER)
