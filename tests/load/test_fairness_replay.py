"""``python -m load.fairness_replay``: issue 43's workload on the real Scheduler with a modelled
clock. Exact step counts, so they are asserted; the modelled times only through the report's
own arithmetic (no wall clock anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from load.fairness_replay import ReplayWorkload, StepCost, main, replay, run

SMALL = ReplayWorkload(
    noisy_concurrency=8,
    noisy_prompt_tokens=200,
    noisy_output_len=16,
    quiet_prompt_tokens=10,
    quiet_output_len=3,
    quiet_requests=8,
    quiet_gap_s=0.2,
    warmup_s=3.0,
)
# two slots, both N's (N keeps eight requests in flight): the case issue 43 found
ENGINE = {"max_num_seqs": 2, "max_num_batched_tokens": 64, "fair_contended_prefill_tokens": 16}


def test_under_fair_q_runs_the_step_after_it_arrives_and_never_finds_a_full_step() -> None:
    fair = replay("fair", SMALL, StepCost(), ENGINE, noisy=True)
    fcfs = replay("fcfs", SMALL, StepCost(), ENGINE, noisy=True)
    assert len(fair.quiet_ttft_ms) == len(fcfs.quiet_ttft_ms) == 8
    # N holds every slot; Q takes one back and its first token comes from the next step
    assert fair.quiet_wait_steps == [1] * 8 and fair.reclaims > 0
    # the step Q arrived in was capped (2 decodes at most + 16 prefill tokens): Q had used
    # the engine before N's load, and is remembered for --fair-contention-window-s
    assert max(fair.inflight_tokens) <= 2 + 16
    # fcfs: Q waits for a slot behind N's requests, in full 64-token steps
    assert max(fcfs.quiet_wait_steps) > 1 and max(fcfs.inflight_tokens) == 64
    assert fcfs.reclaims == 0


def test_a_two_second_window_forgets_q_during_n_s_warm_up() -> None:
    short = replay(
        "fair", SMALL, StepCost(), {**ENGINE, "fair_contention_window_s": 1.0}, noisy=True
    )
    assert max(short.inflight_tokens) == 64  # Q's first request found a full step in flight


def test_the_report_has_both_policies_and_issue_43_targets(tmp_path: Path) -> None:
    cost = StepCost(fixed_ms=10.0, per_token_ms=1.0)
    report = run(["fcfs", "fair"], SMALL, cost, ENGINE)
    fair = report["policies"]["fair"]
    # alone, Q's request is one step of its own prompt: 10 ms + 10 tokens x 1 ms
    assert fair["alone"]["quiet_ttft_ms"]["p90"] == pytest.approx(20.0)
    bound = 20.0 + 2 * fair["with_noisy"]["mean_step_ms"]
    assert report["targets"]["fair_p90_bound_ms"] == pytest.approx(bound)
    out = tmp_path / "replay.json"
    args = ["--noisy-concurrency", "4", "--noisy-prompt-tokens", "120", "--noisy-output-len", "8"]
    args += ["--quiet-requests", "3", "--warmup-s", "1", "--max-num-seqs", "2"]
    assert main([*args, "--max-num-batched-tokens", "64", "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["policies"]) == {"fcfs", "fair"}
