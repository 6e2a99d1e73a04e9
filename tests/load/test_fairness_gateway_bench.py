"""``portico bench fairness --through-gateway``: its targets on hand-made runs, the config it
gives ``portico serve``, and a quick real run (a gateway supervising one tiny engine per policy,
two tenants with their own keys) whose report has every part. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from load import cli as bench_cli
from load.fairness_bench import Timing
from load.fairness_gateway_bench import PoolRun, Workload, build_report, write_config
from load.ttft_breakdown import PARTS


def _timings(*ttfts_s: float) -> list[Timing]:
    return [Timing(ok=True, ttft=t, latency=t + 0.1, output_tokens=4) for t in ttfts_s]


def _run(policy: str, with_noisy: list[Timing], generated: float, noisy: float) -> PoolRun:
    return PoolRun(
        policy,
        alone=_timings(*[0.010] * 9, 0.030),
        with_noisy=with_noisy,
        window_s=2.0,
        steps=100.0,  # 20 ms a step
        generated=generated,
        noisy_generated=noisy,
    )


def test_targets_compare_fair_with_its_own_solo_p90_plus_two_steps_and_with_fcfs() -> None:
    fcfs = _run("fcfs", _timings(*[2.0] * 10), generated=1000.0, noisy=960.0)
    fair = _run("fair", _timings(*[0.030] * 9, 0.070), generated=980.0, noisy=900.0)
    report = build_report([fcfs, fair], Workload(), "m", ["--max-num-seqs", "16"])
    pools = report["policies"]
    assert pools["fair"]["mean_step_ms"] == pytest.approx(20.0)
    assert pools["fair"]["quiet_ttft_ms_alone"]["p90"] == pytest.approx(10.0)  # nearest rank
    assert pools["fair"]["total_output_tok_s"] == pytest.approx(490.0)
    assert pools["fair"]["noisy_output_tok_s"] == pytest.approx(450.0)
    targets = report["targets"]
    assert targets["fair_p90_bound_ms"] == pytest.approx(10.0 + 2 * 20.0)
    assert targets["fair_p90_ms"] == pytest.approx(30.0)
    assert targets["fair_p90_within_alone_plus_2_steps"] is True
    assert targets["fair_total_at_least_0_95_fcfs"] is True  # 0.98
    assert targets["fair_noisy_within_10_percent_of_fcfs"] is True  # 0.9375

    slow = _run("fair", _timings(*[0.1] * 10), generated=900.0, noisy=800.0)
    missed = build_report([fcfs, slow], Workload(), "m", [])["targets"]
    assert missed["fair_p90_within_alone_plus_2_steps"] is False
    assert missed["fair_total_at_least_0_95_fcfs"] is False  # 0.90
    assert missed["fair_noisy_within_10_percent_of_fcfs"] is False  # 0.83
    assert build_report([fair], Workload(), "m", [])["targets"] == {}


def test_rounds_pool_per_policy_and_fixed_windows_make_the_throughput_ratios() -> None:
    """Two rounds (ABBA): each policy's figures pool both rounds, each round's own ratios are
    listed; with fixed windows on both pools the targets' ratios are theirs, not the Q
    windows' (which under fcfs last longer and hold another part of N's cycle)."""
    runs = []
    for round_, (fair_tokens, fcfs_tokens) in enumerate([(950.0, 1000.0), (1020.0, 1000.0)]):
        fair = _run("fair", _timings(*[0.030] * 10), generated=fair_tokens, noisy=900.0)
        fcfs = _run("fcfs", _timings(*[2.0] * 10), generated=2400.0, noisy=2300.0)
        fcfs.window_s = 6.0  # Q took three times as long under fcfs
        for run, tokens in ((fair, fair_tokens), (fcfs, fcfs_tokens)):
            run.round, run.fixed_window_s = round_, 2.0
            run.fixed_generated, run.fixed_noisy_generated = tokens, tokens - 50.0
        runs += [fair, fcfs] if round_ == 0 else [fcfs, fair]
    report = build_report(runs, Workload(), "m", [])
    fair_pool = report["policies"]["fair"]
    assert len(fair_pool["quiet_ttft_s"]["with_noisy"]) == 20 and fair_pool["steps"] == 200.0
    assert fair_pool["fixed_total_output_tok_s"] == pytest.approx((950 + 1020) / 4.0)
    assert report["policies"]["fcfs"]["total_output_tok_s"] == pytest.approx(400.0)
    targets = report["targets"]
    assert targets["throughput_window"] == "fixed"
    assert targets["fair_total_over_fcfs_total"] == pytest.approx(1970 / 2000)
    assert targets["fair_noisy_over_fcfs_noisy"] == pytest.approx(1870 / 1900)
    assert [r["round"] for r in report["rounds"]] == [0, 1]
    assert [r["fair_total_over_fcfs_total"] for r in report["rounds"]] == pytest.approx(
        [0.95, 1.02]
    )
    # without fixed windows: the Q windows, as before (fair 492.5 tok/s against fcfs's 400)
    for run in runs:
        run.fixed_window_s = 0.0
    plain = build_report(runs, Workload(), "m", [])["targets"]
    assert plain["throughput_window"] == "quiet tenant's"
    assert plain["fair_total_over_fcfs_total"] == pytest.approx(492.5 / 400.0)


def test_the_gateway_config_has_one_pool_per_policy_on_the_packaged_plans(tmp_path: Path) -> None:
    path = write_config(tmp_path, 8000, "unix:///r.sock", "m", ["fcfs", "fair"], ["--x", "1"])
    config = yaml.safe_load(path.read_text())
    assert [(e["name"], e["args"]) for e in config["engines"]] == [
        ("fairness-fcfs", ["--x", "1", "--scheduling-policy", "fcfs"]),
        ("fairness-fair", ["--x", "1", "--scheduling-policy", "fair"]),
    ]
    assert config["redis"]["plans_file"].endswith("policies/plans.yaml")
    routing = yaml.safe_load((tmp_path / "policies" / "routing.yaml").read_text())
    assert routing["tiers"] == [{"name": "only", "model": "fairness-fcfs"}]


@pytest.mark.slow
def test_quick_run_through_the_gateway_reports_both_policies(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "fairness_gateway.json"
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "fairness", "--through-gateway", "--quick",
            "--model", str(tiny_llama_dir),
            "--engine-args=--kv-cache-memory 32MiB --max-num-seqs 4 --max-model-len 512",
            "--out", str(out), "--plot", str(tmp_path / "plot"), "--no-progress",
        ]
    )  # fmt: skip
    assert bench_cli.run(args) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fairness-through-gateway" and report["plan"] == "enterprise"
    assert list(report["policies"]) == ["fcfs", "fair"]
    for r in report["policies"].values():
        assert r["quiet_failed"] == 0 and len(r["quiet_ttft_s"]["with_noisy"]) == 3
        assert r["noisy_finished"] >= 2 and r["steps"] > 0 and r["mean_step_ms"] > 0
        # N's tokens as the engine counted them for the tenant the gateway named
        assert 0 < r["noisy_output_tok_s"] <= r["total_output_tok_s"]
        # Q's TTFT in parts, from the gateway's and the engine's spans of each chat's trace
        for phase in ("alone", "with_noisy"):
            summary = r["quiet_ttft_breakdown_ms"][phase]
            assert summary["num_requests"] == 3
            for row in summary["rows"]:
                assert sum(row[p] for p in PARTS) == pytest.approx(row["ttft"], abs=1.0)
                assert row["to_schedule"] >= 0 and row["prefill"] > 0
                assert 0 <= row["step_in_flight"] <= row["inflight_step"]
                assert row["steps_to_schedule"] >= 1 and row["steps_to_first_token"] >= 1
    # six of N's chats on four slots: under fair, Q's chats took slots back
    assert report["policies"]["fcfs"]["preemptions"] == 0
    assert report["policies"]["fair"]["preemptions"] > 0
    assert set(report["targets"]) >= {
        "fair_p90_within_alone_plus_2_steps",
        "fair_total_at_least_0_95_fcfs",
        "fair_noisy_within_10_percent_of_fcfs",
    }
    for path in report["plots"]:
        assert Path(path).stat().st_size > 0
