"""Tenant fairness counted in scheduler steps, not seconds: ``load/fairness_bench.py``'s workload
on an in-process ``LLMEngine``, so the answer does not depend on the machine's load.

    python -m load.fairness_steps                      # the default model
    python -m load.fairness_steps --model DIR --steps 120

For each policy: tenant N keeps ``--noisy-concurrency`` requests queued or running (a new one
as each ends); from step ``--settle-steps`` on, tenant Q adds one short request whenever it has
none in flight. Reported per policy: how many steps Q's requests waited for their first token
(p50, mean, max) and how many tokens the engine computed in those steps (the steps' size: on a
CPU a step's time is about a fixed cost plus a cost per token, so both matter), how many of
N's requests finished in ``--steps`` steps, and the tokens computed in all. No prompt repeats,
so the prefix cache serves nobody. Greedy decoding with ``ignore_eos``: every request writes
exactly its ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from load.fairness_bench import QUICK, Workload, token_prompts


@dataclass
class StepCount:
    """One policy's run: Q's waits for a first token (steps) and N's requests finished."""

    policy: str
    quiet_waits: list[int]
    noisy_finished: int
    steps: int
    quiet_wait_tokens: list[int]  # tokens computed from Q's arrival to its first token
    tokens: int  # computed in all the steps


def count_steps(
    engine: Any, policy: str, work: Workload, num_steps: int, settle_steps: int
) -> StepCount:
    """Drive ``engine`` (an ``LLMEngine`` built with ``policy``) for ``num_steps`` steps."""
    from engine.sampling_params import SamplingParams
    from engine.tenancy import TenantTag

    noisy_tag, quiet_tag = TenantTag("noisy"), TenantTag("quiet")
    noisy_seed = random.Random(work.seed + 1)
    quiet_seed = random.Random(work.seed)
    n_params = SamplingParams(max_tokens=work.noisy_output_len, ignore_eos=True, temperature=0)
    q_params = SamplingParams(max_tokens=work.quiet_output_len, ignore_eos=True, temperature=0)
    sent = 0

    def send_noisy() -> None:
        nonlocal sent
        prompt = token_prompts(1, work.noisy_prompt_len, noisy_seed.getrandbits(32))[0]
        engine.add_request(f"n{sent}", prompt, n_params, tenant=noisy_tag)
        sent += 1

    def tokens_so_far() -> int:
        return sum(sum(counts) for counts in engine.scheduler.tenant_tokens.values())

    for _ in range(work.noisy_concurrency):
        send_noisy()
    finished = 0
    waits: list[int] = []
    wait_tokens: list[int] = []
    quiet_id, quiet_sent_at, quiet_sent_tokens, quiet_count = None, 0, 0, 0
    for step in range(1, num_steps + 1):
        for out in engine.step():
            first = out.outputs and len(out.outputs[0].token_ids) >= 1
            if out.request_id == quiet_id and first and quiet_sent_at:
                waits.append(step - quiet_sent_at)
                wait_tokens.append(tokens_so_far() - quiet_sent_tokens)
                quiet_sent_at = 0
            if out.finished and out.request_id.startswith("n"):
                finished += 1
                send_noisy()
            elif out.finished and out.request_id == quiet_id:
                quiet_id = None
        if step >= settle_steps and quiet_id is None:
            quiet_id, quiet_sent_at, quiet_sent_tokens = f"q{quiet_count}", step, tokens_so_far()
            quiet_count += 1
            quiet = token_prompts(1, work.quiet_prompt_len, quiet_seed.getrandbits(32))[0]
            engine.add_request(quiet_id, quiet, q_params, tenant=quiet_tag)
    return StepCount(policy, waits, finished, num_steps, wait_tokens, tokens_so_far())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.fairness_steps", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policies", default="fcfs,fair")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--settle-steps", type=int, default=40, help="N alone before Q starts")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="the benchmark's quick sizes")
    parser.add_argument("--noisy-prompt-len", type=int, default=256)
    parser.add_argument("--noisy-output-len", type=int, default=4)
    parser.add_argument(
        "--fair-contended-prefill-tokens",
        type=int,
        default=None,
        help="the engine flag of that name for the fair policy (default: the engine's)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_loader import choose_device, choose_dtype, load_model
    from portico.registry import resolve

    work = QUICK if args.quick else Workload(
        noisy_prompt_len=args.noisy_prompt_len, noisy_output_len=args.noisy_output_len,
        quiet_prompt_len=16, quiet_output_len=4,
    )  # fmt: skip
    device = choose_device("auto")
    loaded = load_model(resolve(args.model), choose_dtype("auto", device), device, "auto")
    contended = {}
    if args.fair_contended_prefill_tokens is not None:
        contended["fair_contended_prefill_tokens"] = args.fair_contended_prefill_tokens
    results = []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        config = EngineConfig(
            model=args.model,
            device=str(device),
            scheduling_policy=policy,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=64,
            **contended,
        )
        with torch.inference_mode():
            result = count_steps(
                LLMEngine(config, loaded), policy, work, args.steps, args.settle_steps
            )
        results.append(result)
        waits = result.quiet_waits or [0]
        wait_tokens = result.quiet_wait_tokens or [0]
        print(
            f"{policy}: Q waited {statistics.median(waits):g} steps (p50), "
            f"{statistics.fmean(waits):.1f} (mean), {max(waits)} (max) "
            f"for a first token over {len(result.quiet_waits)} requests, "
            f"{statistics.median(wait_tokens):g} tokens computed meanwhile (p50), "
            f"{max(wait_tokens)} (max); N finished {result.noisy_finished} requests in "
            f"{result.steps} steps, {result.tokens} tokens computed"
        )
    if args.out:
        report = {"workload": asdict(work), "results": [asdict(r) for r in results]}
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if all(r.quiet_waits for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
