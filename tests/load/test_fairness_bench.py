"""``portico bench fairness``: its report math on hand-made timings, and a quick real run (two
real ``portico engine`` processes serving the tiny Llama, fcfs then fair) whose report has every
part and whose engines counted both tenants. No timing is asserted: the numbers are the
benchmark's business, not the test's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from load import cli as bench_cli
from load.fairness_bench import PolicyRun, Timing, Workload, build_report


def _timings(*ttfts_s: float, tokens: int = 4) -> list[Timing]:
    return [Timing(ok=True, ttft=t, latency=t + 0.1, output_tokens=tokens) for t in ttfts_s]


def test_report_math_and_targets_on_hand_made_runs() -> None:
    work = Workload(quiet_requests=4)
    fcfs = PolicyRun(
        "fcfs",
        alone=_timings(0.010, 0.010, 0.010, 0.020),
        with_noisy=_timings(0.100, 0.200, 0.300, 0.400),
        window_s=2.0,
        generated_tokens=1016.0,
    )
    fair = PolicyRun(
        "fair",
        alone=_timings(0.010, 0.010, 0.010, 0.020),
        with_noisy=_timings(0.015, 0.020, 0.025, 0.030),
        window_s=2.0,
        generated_tokens=996.0,
    )
    report = build_report([fcfs, fair], work, "m", ["--x"])
    assert report["policies_run"] == ["fcfs", "fair"]
    summary = report["summary"]
    assert summary["quiet_ttft_ms"]["alone"]["p99"] == pytest.approx(20.0)
    assert summary["quiet_ttft_ms"]["fcfs"]["p99"] == pytest.approx(400.0)
    assert summary["quiet_ttft_ms"]["fair"]["p50"] == pytest.approx(22.5)
    # N's tokens are the engine's total minus Q's (4 requests x 4 tokens), over the window
    assert summary["noisy_output_tok_s"]["fcfs"] == pytest.approx((1016 - 16) / 2.0)
    assert summary["total_output_tok_s"]["fair"] == pytest.approx(996 / 2.0)
    targets = report["targets"]
    assert targets["fair_p99_over_alone_p99"] == pytest.approx(1.5)
    assert targets["fcfs_p99_over_fair_p99"] == pytest.approx(400 / 30)
    assert targets["fair_p99_within_2x_alone"] is True
    assert targets["fair_p99_3x_better_than_fcfs"] is True
    assert targets["fair_total_at_least_0_95_fcfs"] is True  # 996 / 1016 = 0.98

    slow_fair = PolicyRun(
        "fair", alone=fair.alone, with_noisy=_timings(0.1, 0.1, 0.1, 0.2), window_s=2.0,
        generated_tokens=500.0,
    )  # fmt: skip
    missed = build_report([fcfs, slow_fair], work, "m", [])["targets"]
    assert missed["fair_p99_within_2x_alone"] is False
    assert missed["fair_p99_3x_better_than_fcfs"] is False
    assert missed["fair_total_at_least_0_95_fcfs"] is False


def test_rounds_of_one_policy_pool_their_timings_and_tokens() -> None:
    first = PolicyRun(
        "fair", alone=_timings(0.01), with_noisy=_timings(0.02), window_s=2.0,
        generated_tokens=100.0, tenant_tokens={"noisy": 90.0, "quiet": 3.0}, round_tok_s=[50.0],
    )  # fmt: skip
    second = PolicyRun(
        "fair", alone=_timings(0.03), with_noisy=_timings(0.04), window_s=1.0,
        generated_tokens=20.0, tenant_tokens={"noisy": 15.0}, round_tok_s=[20.0],
    )  # fmt: skip
    first.add(second)
    assert [t.ttft for t in first.with_noisy] == [0.02, 0.04]
    assert (first.window_s, first.generated_tokens) == (3.0, 120.0)
    assert first.tenant_tokens == {"noisy": 105.0, "quiet": 3.0}
    report = build_report([first], Workload(), "m", [])["policies"]["fair"]
    assert report["total_output_tok_s"] == pytest.approx(40.0)  # pooled: 120 tokens / 3 s
    assert report["total_output_tok_s_each_round"] == [50.0, 20.0]


def test_one_policy_alone_reports_no_targets() -> None:
    run = PolicyRun("fair", alone=_timings(0.01), with_noisy=_timings(0.02), window_s=1.0)
    report = build_report([run], Workload(), "m", [])
    assert report["targets"] == {}
    assert set(report["summary"]["quiet_ttft_ms"]) == {"alone", "fair"}


@pytest.mark.slow
def test_quick_run_reports_both_policies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fairness.json"
    args = bench_cli_args(tiny_llama_dir, out, tmp_path / "plot")
    assert bench_cli.run(args) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fairness"
    assert report["policies_run"] == ["fcfs", "fair"]
    assert set(report["summary"]["quiet_ttft_ms"]) == {"alone", "fcfs", "fair"}
    for policy in ("fcfs", "fair"):
        r = report["policies"][policy]
        assert r["quiet_failed"] == 0
        assert len(r["quiet_ttft_s"]["alone"]) == len(r["quiet_ttft_s"]["with_noisy"]) == 4
        assert r["noisy_finished"] >= 4  # the warm-up's worth finished before Q ran
        assert r["generated_tokens"] > r["quiet_output_tokens"] == 4 * 4
        # the engine charged both tenants by the engine-hop headers the benchmark sent
        tenants = r["engine_tenant_generation_tokens"]
        assert tenants["quiet"] > 0 and tenants["noisy"] > 0
    assert set(report["targets"]) >= {
        "fair_p99_within_2x_alone",
        "fair_p99_3x_better_than_fcfs",
        "fair_total_at_least_0_95_fcfs",
    }
    for path in report["plots"]:
        assert Path(path).stat().st_size > 0


def bench_cli_args(model_dir: Path, out: Path, plot: Path) -> argparse.Namespace:
    """``portico bench fairness --quick ...`` parsed by the real CLI parser."""
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(
        [
            "fairness",
            "--quick",
            "--model", str(model_dir),
            "--engine-args=--kv-cache-memory 32MiB --max-num-seqs 32 --max-model-len 512",
            "--out", str(out),
            "--plot", str(plot),
            "--no-progress",
        ]
    )  # fmt: skip


def test_in_steps_fair_serves_the_quiet_tenant_first_at_the_same_throughput(
    tiny_llama_dir: Path,
) -> None:
    """``load/fairness_steps.py`` on the tiny Llama in process: counted in scheduler steps, so
    no clock is involved. N's prefill backlog spans many 256-token steps; under fcfs Q's short
    request queues behind it, under fair it is scheduled in the next step, and N finishes as
    many requests per token computed either way. (Per token, not per step: each of Q's
    requests gets a short step of its own under fair, ~20 tokens instead of 256, which costs
    N that step's count but little of its time, a step's time being mostly per token.)"""
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load_model
    from load.fairness_steps import count_steps
    from portico.registry import resolve

    loaded = load_model(resolve(str(tiny_llama_dir)), torch.float32, torch.device("cpu"), "auto")
    work = Workload(noisy_prompt_len=256, noisy_output_len=4, quiet_prompt_len=16)
    counts = {}
    for policy in ("fcfs", "fair"):
        # the contended step cap at the budget: this counts the short steps' price alone (the
        # cap's own, steps of fewer tokens, is the replay's and the cap tests' business)
        config = EngineConfig(
            model="tiny", device="cpu", scheduling_policy=policy, max_num_batched_tokens=256,
            num_gpu_blocks_override=512, fair_contended_prefill_tokens=256,
        )  # fmt: skip
        counts[policy] = count_steps(LLMEngine(config, loaded), policy, work, 60, 20)
    fcfs, fair = counts["fcfs"], counts["fair"]
    assert fcfs.quiet_waits and fair.quiet_waits
    assert max(fair.quiet_waits) == 1 < max(fcfs.quiet_waits)
    assert max(fair.quiet_wait_tokens) <= 256 < max(fcfs.quiet_wait_tokens)  # one step's worth
    fair_rate, fcfs_rate = fair.noisy_finished / fair.tokens, fcfs.noisy_finished / fcfs.tokens
    assert abs(fair_rate - fcfs_rate) <= 0.05 * fcfs_rate
    # the steps fair gave Q cost N at most one step each
    assert fcfs.noisy_finished - fair.noisy_finished <= len(fair.quiet_waits)
