"""Issue 43's gateway workload replayed on the real Scheduler with a modelled clock: exact step
counts, and times that do not depend on what else runs on the machine.

    python -m load.fairness_replay                       # fcfs and fair, issue 43's mix
    python -m load.fairness_replay --fixed-ms 81 --per-token-ms 0.75 --out FILE

No model runs: each step's time is ``--fixed-ms`` + ``--per-token-ms`` x its scheduled tokens
(a CPU step's cost, measured in docs/benchmarks.md, "What a step costs"), and the clock moves
by that. Tenant N keeps ``noisy_concurrency`` requests in flight (a new one when one ends);
after ``warmup_s`` of N's load (Q sent one request as N started, as in the bench, where Q's
solo phase comes first on the same engine), tenant Q sends one short request at a time, a
random 0 to 2 x ``quiet_gap_s`` after its previous one ended. A request that arrives during a
step joins at the step's end (a step cannot be cut), so its wait for the step in flight is
counted. Reported per policy: Q's TTFT alone and with N (modelled ms: arrival to the end of
the step that gave its first token), the mean step under N, output tokens per modelled second
(all and N's), Q's wait in steps, the tokens of the step in flight when Q arrived and of Q's
own first step, and the slot-share preemptions. The targets are issue 43's, on modelled time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from load.serve_bench import percentiles


@dataclass(frozen=True)
class ReplayWorkload:
    """The gateway bench's mix (load/fairness_gateway_bench.py), in tokens."""

    noisy_concurrency: int = 16
    noisy_prompt_tokens: int = 700
    noisy_output_len: int = 64
    quiet_prompt_tokens: int = 40  # a short chat with the chat template around it
    quiet_output_len: int = 16
    quiet_requests: int = 40
    quiet_gap_s: float = 0.5
    warmup_s: float = 60.0
    seed: int = 0


@dataclass(frozen=True)
class StepCost:
    """A step's modelled time: a fixed part plus a part per scheduled token."""

    fixed_ms: float = 81.0
    per_token_ms: float = 0.75

    def ms(self, num_tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * num_tokens


@dataclass
class Phase:
    """One run of the replay (Q alone, or Q with N) under one policy."""

    quiet_ttft_ms: list[float] = field(default_factory=list)
    quiet_wait_steps: list[int] = field(default_factory=list)  # 1: the step after arrival
    inflight_tokens: list[int] = field(default_factory=list)  # the step Q arrived in
    first_step_tokens: list[int] = field(default_factory=list)  # Q's own first step
    steps: int = 0
    elapsed_ms: float = 0.0
    output_tokens: int = 0
    noisy_output_tokens: int = 0
    reclaims: int = 0


def replay(
    policy: str, work: ReplayWorkload, cost: StepCost, engine: dict[str, Any], *, noisy: bool
) -> Phase:
    """One phase on a fresh :class:`~engine.scheduler.Scheduler` (``engine``: EngineConfig
    fields). With ``noisy``, Q's window starts after ``warmup_s`` of N alone."""
    from engine.config import EngineConfig
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import Scheduler
    from engine.tenancy import TenantTag

    now = [0.0]  # modelled seconds
    config = EngineConfig(scheduling_policy=policy, **engine)
    sched = Scheduler(config, 8192, max_model_len=4096, clock=lambda: now[0])
    rng = random.Random(work.seed)
    tags = {"noisy": TenantTag("noisy"), "quiet": TenantTag("quiet")}
    ids = iter(range(10**9))

    def add(tenant: str, prompt_len: int, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        req = Request(f"{tenant}-{next(ids)}", prompt, params, tenant=tags[tenant])
        req.arrival_time = now[0]
        sched.add_request(req)
        return req

    phase = Phase()
    gaps = random.Random(work.seed + 1)
    if noisy:  # as in the bench, Q has used the engine before N's load (untimed)
        add("quiet", work.quiet_prompt_tokens, work.quiet_output_len)
        for _ in range(work.noisy_concurrency):
            add("noisy", work.noisy_prompt_tokens, work.noisy_output_len)
    next_quiet = work.warmup_s if noisy else 0.0
    quiet: Request | None = None
    quiet_arrived = (0.0, 0, 0)  # (time, step count, tokens of the step in flight)
    start_steps = start_out = start_noisy = start_reclaims = -1
    start_ms = -1.0
    last_tokens = 0
    while len(phase.quiet_ttft_ms) < work.quiet_requests:
        if quiet is None and now[0] >= next_quiet:
            if start_steps < 0:
                start_steps, start_ms = phase.steps, now[0] * 1000
                start_out, start_noisy = phase.output_tokens, phase.noisy_output_tokens
                start_reclaims = sched.num_reclaims
            quiet = add("quiet", work.quiet_prompt_tokens, work.quiet_output_len)
            quiet_arrived = (next_quiet, phase.steps, last_tokens if noisy else 0)
        out = sched.schedule()
        if out.is_empty:  # nothing to run: Q alone between requests
            now[0] = max(now[0], next_quiet)
            continue
        last_tokens = out.num_scheduled_tokens
        now[0] += cost.ms(last_tokens) / 1000
        phase.steps += 1
        sampled = {
            r.request_id: 7 for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens
        }
        had_token = quiet is not None and quiet.num_output_tokens > 0
        finished = sched.update_from_output(out, sampled)
        phase.output_tokens += len(sampled)
        phase.noisy_output_tokens += sum(1 for rid in sampled if rid.startswith("noisy"))
        if quiet is not None and not had_token and quiet.num_output_tokens > 0:
            arrived, arrived_step, inflight = quiet_arrived
            phase.quiet_ttft_ms.append((now[0] - arrived) * 1000)
            phase.quiet_wait_steps.append(phase.steps - arrived_step)
            phase.inflight_tokens.append(inflight)
            phase.first_step_tokens.append(last_tokens)
        for req in finished:
            if req.tenant.name == "noisy":
                add("noisy", work.noisy_prompt_tokens, work.noisy_output_len)
            elif req is quiet:  # a random gap, so Q does not arrive in step with the steps
                quiet = None
                next_quiet = now[0] + gaps.uniform(0.0, 2 * work.quiet_gap_s)
    phase.steps -= max(start_steps, 0)
    phase.elapsed_ms = now[0] * 1000 - max(start_ms, 0)
    phase.output_tokens -= max(start_out, 0)
    phase.noisy_output_tokens -= max(start_noisy, 0)
    phase.reclaims = sched.num_reclaims - max(start_reclaims, 0)
    return phase


def _summary(phase: Phase) -> dict[str, Any]:
    ttft = percentiles([ms / 1000 for ms in phase.quiet_ttft_ms])
    seconds = phase.elapsed_ms / 1000 or 1.0
    return {
        "quiet_ttft_ms": {
            "p50": ttft["median"],
            "p90": ttft["p90"],
            "max": max(phase.quiet_ttft_ms),
        },
        "quiet_wait_steps": {
            "mean": statistics.fmean(phase.quiet_wait_steps),
            "max": max(phase.quiet_wait_steps),
        },
        "inflight_tokens_mean": statistics.fmean(phase.inflight_tokens),
        "inflight_tokens_max": max(phase.inflight_tokens),
        "first_step_tokens_mean": statistics.fmean(phase.first_step_tokens),
        "steps": phase.steps,
        "mean_step_ms": phase.elapsed_ms / phase.steps if phase.steps else 0.0,
        "total_output_tok_s": phase.output_tokens / seconds,
        "noisy_output_tok_s": phase.noisy_output_tokens / seconds,
        "reclaims": phase.reclaims,
    }


def run(
    policies: Sequence[str], work: ReplayWorkload, cost: StepCost, engine: dict[str, Any]
) -> dict[str, Any]:
    """Q alone and Q with N per policy, and issue 43's targets (fair against fcfs)."""
    report: dict[str, Any] = {
        "benchmark": "fairness-replay",
        "workload": asdict(work),
        "step_cost": asdict(cost),
        "engine": engine,
        "policies": {},
    }
    for policy in policies:
        alone = _summary(replay(policy, work, cost, engine, noisy=False))
        with_noisy = _summary(replay(policy, work, cost, engine, noisy=True))
        report["policies"][policy] = {"alone": alone, "with_noisy": with_noisy}
    pools = report["policies"]
    if "fair" in pools and "fcfs" in pools:
        fair, fcfs = pools["fair"], pools["fcfs"]
        bound = fair["alone"]["quiet_ttft_ms"]["p90"] + 2 * fair["with_noisy"]["mean_step_ms"]
        report["targets"] = {
            "fair_p90_bound_ms": bound,
            "fair_p90_ms": fair["with_noisy"]["quiet_ttft_ms"]["p90"],
            "fair_p90_within_alone_plus_2_steps": fair["with_noisy"]["quiet_ttft_ms"]["p90"]
            <= bound,
            "fair_total_over_fcfs_total": fair["with_noisy"]["total_output_tok_s"]
            / fcfs["with_noisy"]["total_output_tok_s"],
            "fair_noisy_over_fcfs_noisy": fair["with_noisy"]["noisy_output_tok_s"]
            / fcfs["with_noisy"]["noisy_output_tok_s"],
        }
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m load.fairness_replay", description=__doc__)
    parser.add_argument("--policies", default="fcfs,fair")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument(
        "--engine-flags", default="{}", help="JSON of more EngineConfig fields (fair_* ...)"
    )
    for name, value in {**asdict(ReplayWorkload()), **asdict(StepCost())}.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = ReplayWorkload(**{k: getattr(args, k) for k in asdict(ReplayWorkload())})
    cost = StepCost(**{k: getattr(args, k) for k in asdict(StepCost())})
    engine = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **json.loads(args.engine_flags),
    }
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    report = run(policies, work, cost, engine)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text, file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
